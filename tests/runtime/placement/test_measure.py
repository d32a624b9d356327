"""Measuring a stage's first calls inline: their cost, GIL-free share, faults and move costs."""

import statistics
import time

import pytest
import torch

from torchpipe.runtime.placement import gil as gil_module
from torchpipe.runtime.placement import measure as measure_module
from torchpipe.runtime.placement import memory_costs
from torchpipe.runtime.placement.costs import THREAD, CallCosts, workers
from torchpipe.runtime.placement.measure import measure_calls, move_costs


def _python(n):
    total = 0
    for i in range(n):
        total += i
    return total


def test_measuring_tells_python_from_waiting():
    busy, ran = measure_calls(lambda n: [_python(20_000) for _ in range(n)])
    assert ran >= 1 and busy.gil_free < 0.5 and busy.cpu_s > 0.5 * busy.call_s
    idle, _ = measure_calls(lambda n: [time.sleep(0.002) for _ in range(n)])
    # The GIL probe shares the cores with whatever else runs: on a loaded machine a sleep reads
    # about half GIL-free (0.4998 seen), so the order is what must hold, and the CPU time.
    assert idle.gil_free > busy.gil_free and idle.cpu_s < 0.5 * idle.call_s and idle.call_s >= 0.002


def test_measuring_stops_when_the_calls_run_out():
    supply = iter(range(3))
    costs, ran = measure_calls(lambda n: [x for _, x in zip(range(n), supply)])
    assert ran == 3
    assert measure_calls(lambda n: [])[1] == 0


def test_a_call_that_takes_the_measuring_time_alone_is_measured_once():
    # A second would take as long again on one core, the others idle (an epoch of 16 JPEG
    # batches lost 2 of them to measuring).
    _, ran = measure_calls(lambda n: [time.sleep(2 * measure_module._PROBE_S) for _ in range(n)])
    assert ran == 1
    _, ran = measure_calls(lambda n: [time.sleep(measure_module._PROBE_S / 20) for _ in range(n)])
    assert ran > 1  # short ones: the second half measures them without the GIL probe


def test_a_gil_free_share_counts_only_as_far_as_the_probe_could_resolve_it(monkeypatch):
    # Calls with large results are probed one at a time (blobs' 2 MB batches: a window of 0.5 ms,
    # 2-3 of the probe's ticks, read 0.0-0.77 GIL-free, and threads were tried at 2.7x slower):
    # a share over a window too short for MIN_TICKS ticks counts in proportion, not whole.
    monkeypatch.setattr(measure_module, "_PROBE_S", 60.0)  # bytes stop them here, not time

    def run(n):  # GIL-free calls (a sleep), one result fills the first half's bytes
        out = []
        for _ in range(n):
            time.sleep(0.02)  # long enough for the probe to tick on a loaded machine
            out.append(torch.empty(3 << 20, dtype=torch.uint8))
        return out

    monkeypatch.setattr(gil_module, "MIN_TICKS", 10**6)  # no window resolves a share
    unresolved, _ = measure_calls(run)
    monkeypatch.setattr(gil_module, "MIN_TICKS", 1)  # every window does
    resolved, _ = measure_calls(run)
    assert unresolved.gil_free < 0.01 and resolved.gil_free > 0.2


def test_measuring_holds_few_large_results(monkeypatch):
    # Every result measured is held until the consumer takes it: calls whose results are large
    # stop at a few (each half's first runs whatever its size), small ones run eight.
    monkeypatch.setattr(measure_module, "_PROBE_S", 60.0)  # bytes stop them here, not time
    _, ran = measure_calls(lambda n: [torch.ones(3 << 20, dtype=torch.uint8) for _ in range(n)])
    assert ran == 2  # 3 MiB (past 2); then 6 (past 4, the two halves' share)
    _, ran = measure_calls(lambda n: [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(n)])
    assert ran == 4  # 1 MiB, then 2; then 3, 4
    _, ran = measure_calls(lambda n: [torch.ones(10 << 20, dtype=torch.uint8) for _ in range(n)])
    assert ran == 2
    _, ran = measure_calls(lambda n: list(range(n)))
    assert ran == measure_module._PROBE_CALLS


def test_moving_a_large_result_costs_more_than_a_small_one_and_unpicklable_ones_cannot_move():
    rows = [bytes([i % 256]) * 100 for i in range(4000)]
    (small, small_bytes, _), (large, large_bytes, _) = move_costs({"a": 1}), move_costs(rows)
    assert 0 < small < large and small_bytes < 4000 * 100 < large_bytes
    assert move_costs(lambda: None)[0] == float("inf")


def test_only_blocks_the_allocator_maps_afresh_every_time_count_as_steady_faults():
    big = torch.zeros(40 << 18)  # 40 MiB: above glibc's largest mmap threshold
    _, copied, steady = move_costs({"big": big, "small": torch.zeros(1000)})
    assert steady == big.nbytes and copied < 4096  # tensors are viewed where they land: not copied
    blobs = [bytes([i]) * 65536 for i in range(32)]
    _, copied, steady = move_costs(blobs)
    assert steady == 0 and copied >= 32 * 65536  # blobs are copied out on the receiving side


def test_the_first_calls_page_faults_are_left_out_of_what_a_call_costs():
    """Each call keeps 2 MiB in 64 KiB blobs it never had (as results waiting for the consumer
    do); later calls, once the consumer drops results, reuse those pages: the faults are a cold
    start."""
    if memory_costs.thread_faults() is None:
        pytest.skip("this OS does not count page faults per thread")

    def run(n):
        return [[bytearray(b"\x01") * (64 << 10) for _ in range(32)] for _ in range(n)]

    costs, ran = measure_calls(run)
    warm = []
    for _ in range(7):  # the same calls, each result dropped before the next: its pages reused
        t0 = time.perf_counter()
        run(1)
        warm.append(time.perf_counter() - t0)
    faults = (2 << 20) // memory_costs.PAGE
    cold = statistics.median(warm) + faults * memory_costs.fault_seconds()
    # at most 8 calls, fewer where the machine is so busy that they run past the measuring time
    assert 1 <= ran <= 8 and costs.call_s < max(3 * statistics.median(warm), cold / 2)


def test_page_faults_priced_above_the_cpu_the_calls_took_do_not_make_busy_calls_look_waiting(
    monkeypatch,
):
    """A fault's price is an estimate: priced at more than the calls' CPU, the cold start it
    explains is at most that CPU (faults are CPU time), so busy calls never look as if they wait
    (they asked for 40 threads when it was subtracted whole: a negative CPU time)."""
    if memory_costs.thread_faults() is None:
        pytest.skip("this OS does not count page faults per thread")
    # a second a call: too much
    monkeypatch.setattr(measure_module, "cold_seconds", lambda faults, steady: 1.0)

    def run(n):
        return [[bytearray(b"\x01") * (64 << 10) for _ in range(32)] for _ in range(n)]

    costs, _ = measure_calls(run)
    assert costs.cpu_s > 0.5 * costs.call_s > 0  # busy: not waiting
    assert workers(costs, THREAD, 2) == 2  # a thread a core, not one a wait


def test_forced_costs_report_what_they_force_while_the_calls_run_and_no_longer_after():
    """measure.forced_costs(), the seam of testing.forced_call_costs: the calls run (all of them,
    their global draws watched), their measured cost is the one forced."""
    forced = CallCosts(0.5, 0.25, 0.5, 1e-3)
    ran, drawn = [], []

    def run(n):
        ran.extend(range(n))
        return list(range(n))

    with measure_module.forced_costs(forced):
        assert measure_calls(run, limit=6, on_draws=drawn.append) == (forced, 6)
    assert ran == list(range(6)) and len(drawn) == 1
    costs, _ = measure_calls(lambda n: list(range(n)))
    assert costs != forced and costs.call_s < 0.5


def _counting_decodes(monkeypatch):
    """How many times the measuring decodes a result to price its move (a list, counted in)."""
    decodes = []
    real = measure_module.codec.decode_view

    def decode_view(record):
        decodes.append(len(record))
        return real(record)

    monkeypatch.setattr(measure_module.codec, "decode_view", decode_view)
    return decodes


def test_a_result_dearer_to_move_than_to_make_is_priced_without_timing_every_decode(monkeypatch):
    # Receiving a result copies its blobs at least once: where that copy (or two decodings) cost
    # a call made here, processes cannot win, and timing three decodes of it only took the first
    # epoch's time (~1.5 ms a decoding, of a 25 ms epoch of rows with 64 KB blobs).
    decodes = _counting_decodes(monkeypatch)
    blobs = [bytes([i]) * 65536 for i in range(64)]  # 4 MiB of blobs, made in no time
    costs, _ = measure_calls(lambda n: [blobs for _ in range(n)])
    assert len(decodes) <= 2  # the first is cold: the second prices it
    assert costs.move_s >= costs.call_s and costs.nbytes == move_costs(blobs)[1]
    decodes.clear()
    # a result cheap to move beside its call: the fastest of a few decodes prices it
    costs, _ = measure_calls(lambda n: [(time.sleep(0.003), b"x")[1] for _ in range(n)])
    assert len(decodes) == measure_module._MOVE_SAMPLES and costs.move_s < costs.call_s
    # where processes lose to inline even at a copy of the result's bytes, no decode is timed
    decodes.clear()
    monkeypatch.setattr(measure_module, "processes_cannot_win", lambda costs, cores: True)
    costs, _ = measure_calls(lambda n: [(time.sleep(0.003), b"x")[1] for _ in range(n)])
    assert not decodes and costs.move_s < costs.call_s
    # one that cannot travel cannot move, however cheap its call
    costs, _ = measure_calls(lambda n: [lambda: None for _ in range(n)])
    assert costs.move_s == float("inf")

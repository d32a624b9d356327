"""A stage's placement: measuring the first calls, moving calls on the policy's word, never losing one."""

import dataclasses
import statistics
import time

import pytest
import torch

from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.executor import InlineExecutor, ThreadExecutor
from torchpipe.runtime.placement import driver as driver_module
from torchpipe.runtime.placement import measure as measure_module
from torchpipe.runtime.placement import memory_costs
from torchpipe.runtime.placement import placement as placement_module
from torchpipe.runtime.placement.measure import measure_calls, move_costs
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.placement.policy import (
    INLINE,
    KINDS,
    PROCESS,
    THREAD,
    CallCosts,
    Policy,
    workers,
)
from torchpipe.runtime.timing import CallTiming


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


def test_measuring_holds_few_large_results(monkeypatch):
    # Every result measured is held until the consumer takes it: calls whose results are large
    # stop at a few (each half's first runs whatever its size), small ones run eight.
    monkeypatch.setattr(measure_module, "_PROBE_S", 60.0)  # bytes stop them here, not time
    _, ran = measure_calls(lambda n: [torch.ones(3 << 20, dtype=torch.uint8) for _ in range(n)])
    assert ran == 3  # 3 MiB, then 6 (past 4); then 9 (past 8, the two halves' share)
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


class _Stage:
    """A stage driving a placement: numbered tasks through a dispatcher, as map and the DataLoader do."""

    def __init__(self, policy, kind=INLINE, on_move=None):
        self.timing = CallTiming()
        self.retired = []
        self.dispatch = Dispatcher("stage", InlineExecutor(self.call, self.timing))
        self.placement = Placement(
            self.dispatch, self.make, policy, self.timing, on_move, retire=self.retire
        )
        self.seq = 0
        self.cost_s = 0.0
        self.inside_s = 0.0

    def call(self, seq, x):
        if self.cost_s:
            time.sleep(self.cost_s)
        return x * 2

    def make(self, kind, workers):
        return (
            InlineExecutor(self.call, self.timing)
            if kind == INLINE
            else ThreadExecutor(self.call, workers, kind, self.timing)
        )

    def retire(self, executor):
        self.retired.append(executor)
        executor.close()

    def run(self, count):
        out = []
        for _ in range(count):
            started = time.perf_counter()
            while self.dispatch.has_room():
                self.dispatch.submit(self.seq, self.seq)
                self.seq += 1
            out.append(self.dispatch.take())
            self.inside_s += time.perf_counter() - started  # the rest is the consumer's
            self.placement.delivered(self.inside_s)
        return out


def _windows(monkeypatch, elements):
    """Judge every ``elements`` calls, with no settling after a move to threads or inline."""
    cadence = dataclasses.replace(
        placement_module.CALLS, elements=elements, seconds=0.0, settle_s=0.0
    )
    monkeypatch.setattr(placement_module, "CALLS", cadence)


def test_moves_on_the_policys_word_keep_every_element_in_order(monkeypatch):
    _windows(monkeypatch, 2)
    # on a busy machine a window's cost per element swings past CHANGED, and the driver decides
    # afresh instead of asking the scripted policy: this test is about the moves
    monkeypatch.setattr(driver_module, "cost_changed", lambda now, before: False)
    verdicts = iter([THREAD, THREAD, INLINE, INLINE, INLINE])

    class Scripted(Policy):
        def review(self, seconds_per_element, full=True):
            self.kind = next(verdicts, self.kind)
            return self.kind

    stage = _Stage(Scripted((INLINE, THREAD), 2))
    stage.placement.decide(CallCosts(1e-3, 1e-3, 0.0, 0.0))
    kinds, out = [], []
    for _ in range(8):
        out += stage.run(10)
        kinds.append(stage.placement.kind)
    while stage.dispatch.pending:
        out.append(stage.dispatch.take())
    assert [(s, v) for s, v, _ in out] == [(s, 2 * s) for s in range(len(out))]
    assert THREAD in kinds and INLINE in kinds
    assert any(isinstance(e, ThreadExecutor) for e in stage.retired)


def test_a_verdict_for_a_predicted_executor_waits_for_two_windows_one_back_to_a_measured_one_does_not(
    monkeypatch,
):
    """Going where the policy only predicts a gain takes two windows that agree (one can mislead);
    going back where it measured a better rate than the window just measured (a trial that
    lost) takes one: a measurement against a measurement."""
    _windows(monkeypatch, 2)
    monkeypatch.setattr(driver_module, "cost_changed", lambda now, before: False)
    log = []
    verdicts = iter([THREAD, THREAD, INLINE])

    class Scripted(Policy):
        @property
        def measured(self):
            return {kind: 1e-3 for kind in log if kind in KINDS}  # where the calls ran

        def review(self, seconds_per_element, full=True):
            log.append("window")
            return next(verdicts, self.kind)

    stage = _Stage(Scripted((INLINE, THREAD), 2), on_move=lambda kind, n: log.append(kind))
    stage.placement.decide(CallCosts(1e-6, 1e-6, 0.0, 0.0))
    for _ in range(10):
        stage.run(4)
    stage.dispatch.close()
    assert log[: log.index(INLINE, 1) + 1] == [INLINE, "window", "window", THREAD, "window", INLINE]


def test_calls_whose_cost_changes_are_decided_afresh(monkeypatch):
    _windows(monkeypatch, 4)
    policy = Policy((INLINE, THREAD), 2)
    stage = _Stage(policy)
    # A hand-off dear enough that no busy moment of this test's loop makes threads worth a trial
    # for calls of a microsecond, and cheap beside 3 ms waits.
    stage.placement.decide(CallCosts(1e-6, 1e-6, 0.0, 0.0, handoff_s=1e-3))
    stage.run(30)
    assert stage.placement.kind == INLINE
    stage.cost_s = 0.003  # the calls now wait 3 ms each (I/O): threads overlap the waits
    stage.run(30)
    assert stage.placement.kind == THREAD and stage.placement.workers > 2
    stage.dispatch.close()


def test_the_tuners_zero_means_inline_and_more_means_the_best_pool():
    moves = []
    stage = _Stage(Policy((INLINE, THREAD), 2), on_move=lambda kind, n: moves.append((kind, n)))
    stage.placement.decide(CallCosts(1e-6, 1e-6, 0.0, 0.0))
    del moves[:]  # the first decision's move
    stage.placement.resize(3)
    stage.placement.resize(2)
    stage.placement.resize(0)
    assert moves == [(THREAD, 3), (THREAD, 2), (INLINE, 0)]
    assert [v for _, v, _ in stage.run(5)] == [0, 2, 4, 6, 8]


def test_a_later_pass_resumes_what_was_learned():
    policy = Policy(KINDS, 2)
    stage = _Stage(policy)
    stage.placement.decide(CallCosts(1e-6, 1e-6, 0.0, 0.0))
    learned = {}
    stage.placement.remember(learned)
    assert learned["executor"] == INLINE and learned["costs"].call_s == 1e-6
    again = _Stage(Policy(KINDS, 2))
    assert again.placement.resume(learned, 0) and again.placement.kind == INLINE
    assert not _Stage(Policy(KINDS, 2)).placement.resume({}, 0)
    assert not _Stage(None).placement.resume(learned, 0)  # a fixed executor learns nothing


def test_the_driver_judges_settled_windows_that_follow_each_other():
    from torchpipe.runtime.placement.driver import Cadence, MoveDriver

    driver = MoveDriver(Cadence(elements=3, seconds=1.0, settle_elements=2, settle_process_s=0.5))
    looks = [driver.window(float(n), n, lambda n=n: n) for n in range(1, 9)]
    # Settled at 2 elements; a window needs 3 more and a second: 2 -> 5 -> 8.
    assert looks == [None, None, None, None, (2, 5, 3.0), None, None, (5, 8, 3.0)]
    driver.moved(PROCESS, settle_at=10, now=8.0)  # workers fork: the process settling time too
    assert driver.window(8.1, 10, lambda: 10) is None and driver.window(8.2, 11, lambda: 11) is None
    assert driver.window(9.0, 12, lambda: 12) is None  # settled: the window starts
    assert driver.window(9.5, 15, lambda: 15) is None and driver.window(10.0, 15, lambda: 15) == (
        12,
        15,
        1.0,
    )


def test_a_pass_shorter_than_a_window_is_judged_at_its_end_and_the_next_goes_on_from_its_verdicts():
    from torchpipe.runtime.placement.driver import Cadence, MoveDriver

    driver = MoveDriver(Cadence(elements=3, seconds=1.0, settle_elements=2, agree=2))
    looks = [driver.window(n * 0.01, n, lambda n=n: n) for n in range(1, 7)]
    assert looks == [None] * 6  # 60 ms: no window is a second long
    assert driver.window(0.07, 7, lambda: 7, last=True) == (2, 7, pytest.approx(0.05))
    assert not driver.agreed(INLINE)  # the first epoch's verdict
    driver.new_pass(7)  # the next epoch: its first two elements fill buffers
    assert [driver.window(5 + n * 0.01, 7 + n, lambda n=n: 7 + n) for n in range(1, 4)] == [
        None
    ] * 3
    assert driver.window(5.05, 12, lambda: 12, last=True) == (9, 12, pytest.approx(0.03))
    assert driver.agreed(INLINE)  # the second epoch's agrees: the work moves
    # too few elements: nothing to judge
    assert driver.window(5.1, 13, lambda: 13, last=True) is None
    driver.new_pass(13)
    assert driver.window(6.0, 14, lambda: 14, last=True) is None  # no window spans two passes


def test_the_driver_acts_on_agreeing_verdicts_and_tells_a_changed_cost():
    from torchpipe.runtime.placement.driver import CALLS, CHANGED, OVERLAP, REBASE, MoveDriver

    driver = MoveDriver(CALLS)
    assert [driver.agreed(v) for v in (THREAD, PROCESS, PROCESS, PROCESS, PROCESS)] == [
        False,
        False,
        True,
        False,
        True,
    ]
    # a prefetch acts on one window
    assert all(MoveDriver(OVERLAP).agreed(THREAD) for _ in range(3))
    assert not driver.changed(1e-3) and not driver.changed(1.5e-3)
    # the base stays
    assert driver.changed(1.5e-3 * CHANGED * 1.01) and driver.changed(1.5e-3 * CHANGED * 1.01)
    assert not driver.agreed(REBASE) and driver.agreed(REBASE)
    driver.baseline(1e-2)
    assert not driver.changed(1.2e-2)
    fresh = MoveDriver(CALLS)
    # below the floor: timer noise, no change
    assert not fresh.changed(1e-9) and not fresh.changed(5e-8)


class _CountedClocks:
    """``time`` as runtime/timing.py reads it, counting the reads of the thread's CPU clock."""

    def __init__(self):
        self.cpu_reads = 0
        self.perf_counter = time.perf_counter

    def thread_time(self):
        self.cpu_reads += 1
        return time.thread_time()


def test_cheap_inline_calls_are_clocked_one_in_a_few_and_all_counted(monkeypatch):
    """#59 item 2: a call on the consumer's thread under SAMPLED_BELOW_S reads the CPU clock one
    call in SAMPLE_EVERY (two reads a clocked call, ~2.5 us), every call is counted, and calls
    that turn dear are clocked from the next one on (a placement must see a cost that changed)."""
    from torchpipe.runtime import timing as timing_module

    clocks = _CountedClocks()
    monkeypatch.setattr(timing_module, "time", clocks)
    cost = [0.0]

    def call(seq, x):
        if cost[0]:
            time.sleep(cost[0])
        return x

    inline = InlineExecutor(call, CallTiming())
    n = 1600
    assert [inline.call(seq, seq) for seq in range(n)] == list(range(n))
    clocked = clocks.cpu_reads / 2
    assert 1 <= clocked <= 3 * n / timing_module.SAMPLE_EVERY  # ~100 expected, not 1600
    counted = inline.timing.calls
    # exact up to the calls since the last clock
    assert n - 20 * timing_module.SAMPLE_EVERY <= counted <= n
    cost[0] = 2 * timing_module.SAMPLED_BELOW_S
    before = clocks.cpu_reads
    for seq in range(5):
        inline.call(seq, seq)
    # the first dear call ends the gap: the next four are clocked
    assert clocks.cpu_reads - before >= 2 * 4
    assert inline.timing.calls == n + 5
    assert inline.timing.work_s >= 4 * cost[0]


def test_a_window_that_loses_big_ends_after_a_quarter_of_its_seconds():
    """#59: a trial 2-17x slower than an executor measured before is judged on a quarter window;
    one that does not lose, or a stage with nothing measured to lose against, waits for the whole."""
    from torchpipe.runtime.placement.driver import EARLY, Cadence, MoveDriver

    asked = []

    def slower_than(bound):
        def ask():
            asked.append(bound)
            return bound

        return ask

    for bound, ends in ((0.05, EARLY), (0.5, 1.0), (None, 1.0)):
        driver = MoveDriver(Cadence(elements=3, seconds=1.0, settle_elements=1))
        assert (
            driver.window(0.0, 1, lambda: 1, slower_than=slower_than(bound)) is None
        )  # the window starts
        done = None
        for n in range(2, 200):  # an element every 0.1 s
            done = driver.window((n - 1) * 0.1, n, lambda n=n: n, slower_than=slower_than(bound))
            if done is not None:
                break
        assert done is not None and done[2] == pytest.approx(max(ends, 0.3), abs=0.11)
    # asked once a window, not once an element
    assert asked.count(0.05) == 1 and asked.count(0.5) >= 1


def test_a_trial_that_loses_big_goes_back_before_another_is_tried():
    """#59: ``records``' calls went from a window on threads 2x slower than inline on to
    processes (17x) before coming back; back first, the next trial starts from the best measured."""
    policy = Policy(KINDS, 2)
    calls = CallCosts(200e-6, 200e-6, 0.0, 20e-6, message_s=20e-6)  # processes predicted fastest
    policy.decide(calls)
    policy.moved(INLINE)
    assert policy.review(340e-6) in (
        THREAD,
        PROCESS,
    )  # inline measured; an executor predicted faster is tried
    policy.moved(THREAD)  # (threads, say)
    assert policy.lost_big(policy.measured) is False
    assert policy.review(800e-6) == INLINE  # lost big: back at once, not on to processes
    assert policy.slower_than() == pytest.approx(1.5 * 340e-6)


def test_a_placement_made_never_moving_keeps_its_calls_where_its_first_decision_put_them(
    monkeypatch,
):
    """Placement.never_moving(), the seam tests hold calls with: every window says threads, yet
    a placement made in the block stays inline, in this pass and the next; one made after it moves."""
    _windows(monkeypatch, 2)
    monkeypatch.setattr(driver_module, "cost_changed", lambda now, before: False)

    class Threads(Policy):
        def review(self, seconds_per_element, full=True):
            return THREAD

    with Placement.never_moving():
        held = _Stage(Threads((INLINE, THREAD), 2))
    held.placement.decide(CallCosts(1e-6, 1e-6, 0.0, 0.0))
    assert [v for _, v, _ in held.run(20)] == [2 * x for x in range(20)]
    assert held.placement.kind == INLINE
    moved = _Stage(Threads((INLINE, THREAD), 2))
    moved.placement.decide(CallCosts(1e-6, 1e-6, 0.0, 0.0))
    moved.run(20)
    assert moved.placement.kind == THREAD
    held.placement.move(THREAD, 2)  # an explicit move still moves
    assert held.placement.kind == THREAD
    for stage in (held, moved):
        while stage.dispatch.pending:
            stage.dispatch.take()
        stage.dispatch.close()


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

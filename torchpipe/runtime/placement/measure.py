"""What a stage's first calls cost, measured inline: the evidence of a stage's first placement.

:func:`measure_calls` runs a stage's first calls on the consumer's thread beside a GIL probe and
prices what they would cost elsewhere (page faults of fresh memory left out, the cost of moving a
result between processes measured by decoding one: :func:`move_costs`); the
:class:`~torchpipe.runtime.placement.policy.Policy` decides from what it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from torchpipe.randomness import GlobalDraws, watch_global_draws
from torchpipe.runtime import codec
from torchpipe.runtime.cpu import as_a_pool_thread_runs, grown, run_delay, usable_cpu_count
from torchpipe.runtime.placement.costs import CallCosts
from torchpipe.runtime.placement.gil import GilProbe
from torchpipe.runtime.placement.memory_costs import (
    MMAP_THRESHOLD_MAX,
    byte_seconds,
    calibrate,
    cold_seconds,
    thread_faults,
)
from torchpipe.runtime.placement.policy import processes_cannot_win
from torchpipe.runtime.sizes import element_bytes

_PROBE_CALLS, _PROBE_S = (
    8,
    0.02,
)  # calls measured inline before the first decision (at most; at least one)
_PROBE_BYTES = 2 << 20
"""Bytes of results each half of the measured calls may hold (its first call runs whatever its
size). Every result measured is kept until the consumer takes it, so each faults in fresh pages:
``blobs``' eight 2 MB batches took 12 ms to measure, where delivered one by one they take 2.6;
four took 5.6-6 ms (1.4 ms each, 0.15 ms delivered), two take half as long."""
_MOVE_SAMPLES = 3  # decodings timed for the cost of receiving a result (the fastest counts)
_CALL_FLOOR = 0.1  # a call is taken to cost at least this share of its time, whatever it faulted
_forced: CallCosts | None = None  # what measure_calls reports within forced_costs()
_Timed = tuple[float, float, int]
"""A timed call: ``(seconds, GIL-free share, page faults)`` (:func:`_timed_calls`)."""


def prepare_measurements() -> None:
    """Measure ahead, once a process, what the first decision needs to know of the machine (the
    GIL probe's rate, :func:`~torchpipe.runtime.placement.memory_costs.calibrate`; ~25 ms): a stage that
    will place its calls calls this when it is made, so its first elements do not wait for it."""
    calibrate()
    GilProbe.calibrate()


@contextlib.contextmanager
def forced_costs(costs: CallCosts) -> Iterator[None]:
    """A seam for tests and benchmarks: within the block :func:`measure_calls` still runs its
    calls (all ``limit`` of them at once, watching the global RNGs they draw) but reports
    ``costs`` for each, whatever the machine's load; what it reported before is put back after."""
    global _forced
    before, _forced = _forced, costs
    try:
        yield
    finally:
        _forced = before


def forced_now() -> CallCosts | None:
    """What :func:`forced_costs` forces now; None where calls are measured."""
    return _forced


def measure_calls(
    run: Callable[[int], list[Any]],
    limit: int = _PROBE_CALLS,
    on_draws: Callable[[GlobalDraws], None] | None = None,
) -> tuple[CallCosts, int]:
    """Run up to ``limit`` calls inline (``run(n)`` runs at most ``n`` and returns their results);
    what one call costs at steady state, and how many ran.

    The first half run beside a GIL probe, which measures the share of a call the GIL is free but
    slows calls that release it often (each release lets the probe in); the rest run alone, and
    their median is the cost of a call. They run with one intra-op thread for torch's ops, as on a
    pool thread or in a worker process (:func:`~torchpipe.runtime.cpu.as_a_pool_thread_runs`).
    The first calls are not like the later ones: they fault
    in every page of the results they make, which are all kept until the consumer takes them,
    where later calls reuse the pages of results the consumer dropped; what those faults cost
    (:func:`~torchpipe.runtime.placement.memory_costs.cold_seconds`) is left out of every call, as are
    imports and warm-up by the median. The cost of moving a result between processes is that
    of decoding the first one, and its size (:func:`move_costs`). With ``on_draws``, the first
    half also finds out which global RNGs the calls draw from (``watch_global_draws``; the time
    that takes is left out), and ``on_draws`` is told before the second half runs.
    """
    forced = _forced
    if forced is not None:
        return _run_at_forced_costs(run, limit, on_draws, forced)
    results: list[Any] = []
    probed, alone, cpu = _run_both_halves(run, limit, on_draws, results)
    if not probed:
        return CallCosts(0.0, 0.0, 1.0, 0.0), 0
    return _steady_costs(probed, alone, cpu, results[0]), len(results)


def _run_both_halves(
    run: Callable[[int], list[Any]],
    limit: int,
    on_draws: Callable[[GlobalDraws], None] | None,
    results: list[Any],
) -> tuple[list[_Timed], list[_Timed], float]:
    """:func:`measure_calls`' calls, their results added to ``results``: the first half beside the
    GIL probe (and watching the global RNGs' draws, where ``on_draws``, told after it), the rest
    alone; what each took (:func:`_timed_calls`) and the CPU time of this thread through both."""
    held = _HeldBytes()
    cpu0 = time.thread_time()
    watching = watch_global_draws() if on_draws is not None else contextlib.nullcontext()
    with as_a_pool_thread_runs():
        with GilProbe() as probe, watching as draws:
            overhead = (lambda: draws.overhead_s) if draws is not None else None
            probed = _timed_calls(run, limit // 2, _PROBE_S / 2, results, overhead, probe, held)
        if on_draws is not None:
            on_draws(cast(GlobalDraws, draws))  # watched: not the nullcontext's None
        held.limit += _PROBE_BYTES  # as much again for the second half
        # A call that took the whole time alone is measured once: a second would take as long
        # again on one core (``cache``'s epochs of 16 JPEG batches: 2 of them, ~11% of the epoch).
        more = probed and sum(s for s, _, _ in probed) < _PROBE_S
        alone = (
            _timed_calls(run, limit - len(results), _PROBE_S / 2, results, None, None, held)
            if more
            else []
        )
    return probed, alone, time.thread_time() - cpu0


def _steady_costs(probed: list[_Timed], alone: list[_Timed], cpu: float, first: Any) -> CallCosts:
    """What one call costs at steady state, from the calls timed beside the GIL probe
    (``probed``, at least one) and alone, the CPU time they took and the first result: each
    call's page faults priced (:func:`~torchpipe.runtime.placement.memory_costs.cold_seconds`)
    and left out, the median of the calls run alone (else of all), the GIL-free share the probe
    saw, and what moving ``first`` between processes costs (:func:`move_costs`)."""
    encoded = _encoded(first)
    nbytes, steady_bytes = _sizes(encoded)
    cold = [cold_seconds(faults, steady_bytes) for _, _, faults in probed + alone]
    wall = sum(s for s, _, _ in probed + alone)
    # A fault is CPU time of this thread: the faults' priced time cannot exceed the CPU the calls
    # took (a fault in the allocator can cost less than the calibration's; the price is an
    # estimate), else the calls would seem to wait, and ask for dozens of threads.
    cold_s = min(sum(cold), wall * (1 - _CALL_FLOOR), cpu * (1 - _CALL_FLOOR))
    share = cold_s / sum(cold) if sum(cold) > 0 else 0.0
    steady = [max(s - c * share, s * _CALL_FLOOR) for (s, _, _), c in zip(probed + alone, cold)]
    call_s = statistics.median(steady[len(probed) :] or steady)
    probed_s = sum(s for s, _, _ in probed)
    # Receiving a result copies its blobs and pickled data at least once: where that copy alone
    # costs a call made here, or processes moving results at that copy are beyond a trial's
    # reach (processes_cannot_win), the decodes need not be timed; where two decodings cost a
    # call, a third need not be (a batch of 2 MB of blobs: ~1.5 ms a decoding).
    costs = CallCosts(
        call_s=call_s,
        cpu_s=call_s * min(1.0, (cpu - cold_s) / (wall - cold_s)) if wall > cold_s else call_s,
        gil_free=sum(s * free for s, free, _ in probed) / probed_s if probed_s > 0 else 1.0,
        move_s=nbytes * byte_seconds(),
        nbytes=nbytes,
    )
    if encoded is not None and (
        costs.move_s >= call_s or processes_cannot_win(costs, usable_cpu_count())
    ):
        return costs
    # infinite where it cannot travel
    return dataclasses.replace(costs, move_s=_decode_seconds(encoded, enough=call_s))


def _run_at_forced_costs(
    run: Callable[[int], list[Any]],
    limit: int,
    on_draws: Callable[[GlobalDraws], None] | None,
    costs: CallCosts,
) -> tuple[CallCosts, int]:
    """:func:`measure_calls` within :func:`forced_costs`: the calls run, their costs are ``costs``."""
    with watch_global_draws() as draws:
        done = run(limit)
    if on_draws is not None:
        on_draws(draws)
    return costs, len(done)


class _HeldBytes:
    """The bytes the measured calls' results hold, and how many they may hold."""

    def __init__(self) -> None:
        self.bytes, self.limit = 0, _PROBE_BYTES

    def add(self, results: list[Any]) -> bool:
        """Count ``results``; True while the limit is not reached."""
        self.bytes += sum(map(element_bytes, results))
        return self.bytes < self.limit


def _timed_calls(
    run: Callable[[int], list[Any]],
    limit: int,
    seconds: float,
    results: list[Any],
    overhead: Callable[[], float] | None,
    probe: GilProbe | None = None,
    held: _HeldBytes | None = None,
) -> list[_Timed]:
    """Up to ``limit`` calls (at least one, if any is left) for at most about ``seconds`` and
    while their results hold less than ``held`` allows:
    ``(seconds, GIL-free share, page faults)`` of each, less ``overhead`` and less the time the
    thread waited for a core others held (:func:`~torchpipe.runtime.cpu.run_delay`: on a busy
    machine a call that computes would otherwise look as if it waited, and ask for threads);
    their results added to ``results``."""
    timed: list[_Timed] = []
    deadline = time.perf_counter() + seconds
    while len(timed) < max(limit, 1):
        spent = overhead() if overhead is not None else 0.0
        delay = run_delay()
        faults = thread_faults()
        done, free, took = _one_call(run, probe)
        if not done:
            break
        faulted = thread_faults()
        delayed = run_delay()
        results.extend(done)
        took -= (overhead() - spent) if overhead is not None else 0.0
        took -= grown(delay, delayed)
        timed.append((max(took, 1e-9), free, grown(faults, faulted)))
        if time.perf_counter() > deadline or (held is not None and not held.add(done)):
            break
    return timed


def _one_call(
    run: Callable[[int], list[Any]], probe: GilProbe | None
) -> tuple[list[Any], float, float]:
    """Run one call: its results, the share of it the GIL was free (``probe``'s measure; 0.0
    without one) and its wall seconds."""
    if probe is not None:
        return probe.measure(lambda: run(1))
    t0 = time.perf_counter()
    done, free = run(1), 0.0
    return done, free, time.perf_counter() - t0


def move_costs(result: Any) -> tuple[float, int, int]:
    """What moving ``result`` from a worker costs: the seconds this process would spend decoding
    it (the fastest of a few tries; the encoding is the worker's), the bytes a move copies on
    each side (its blobs and pickled data; tensors and arrays are written once, in place of the
    stacking this process would do, and viewed where they land), and the bytes of its blocks so
    large that the allocator maps them afresh for every result
    (:data:`~torchpipe.runtime.placement.memory_costs.MMAP_THRESHOLD_MAX`). A result that cannot travel
    costs infinite seconds."""
    encoded = _encoded(result)
    return (_decode_seconds(encoded), *_sizes(encoded))


def _encoded(result: Any) -> Any:
    """``result`` encoded for a worker's ring, or None where it cannot travel."""
    try:
        return codec.encode(codec.materialize(result))
    except Exception:  # noqa: BLE001 - cannot travel: processes would fail on it
        return None


def _sizes(encoded: Any) -> tuple[int, int]:
    """The bytes a move of ``encoded`` copies on each side, and those of its blocks the allocator
    maps afresh (see :func:`move_costs`); none where it cannot travel."""
    if encoded is None:
        return 0, 0
    return encoded.copied_bytes, encoded.bytes_in_blocks(MMAP_THRESHOLD_MAX)


def _decode_seconds(encoded: Any, enough: float = float("inf")) -> float:
    """The fastest of a few decodings of ``encoded`` (infinite where it cannot travel); two only
    where both took ``enough`` seconds (a call made here: processes cannot win then). The first
    is cold (its memory faulted in), so one alone would price a move too high."""
    if encoded is None:
        return float("inf")
    record = np.empty(encoded.nbytes, np.uint8)
    encoded.write_into(memoryview(record))  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only
    best = float("inf")
    for tries in range(1, _MOVE_SAMPLES + 1):
        t0 = time.perf_counter()
        codec.decode_view(record)
        best = min(best, time.perf_counter() - t0)
        if tries >= 2 and best >= enough:
            break
    return best

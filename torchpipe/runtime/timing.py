"""What a pool measures of the calls it runs: how many, their wall and CPU seconds, and how long
they waited for a core."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchpipe.runtime.cpu import run_delay

if TYPE_CHECKING:
    from torchpipe.observe.tracing import CallTracer


class CallTiming:
    """Totals over the calls a stage ran on pool threads or worker processes; thread-safe.

    ``work_s`` is each call's wall time (what the call cost its thread or worker, waits on I/O
    included), ``cpu_s`` its CPU time, ``delay_s`` the time it was ready to run but waited for a
    core others held (:func:`~torchpipe.runtime.cpu.run_delay`); CPU and delay together over the
    wall time tell a call that wants a core (compute, on a busy machine or not) from one that
    waits on I/O. ``items`` counts
    the elements the calls read, for stages that read ahead of their consumer (interleaves, whose
    calls are one read or a chunk of them); 0 where a stage does not count them.
    """

    __slots__ = ("_lock", "calls", "work_s", "cpu_s", "delay_s", "items", "trace")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.work_s = 0.0
        self.cpu_s = 0.0
        self.delay_s = 0.0
        self.items = 0
        self.trace: CallTracer | None = None  # set when the pass is traced (Options(trace=...))

    def add(self, wall_s: float, cpu_s: float, calls: int = 1, items: int = 0, start: float | None = None,
            where: str | None = None, pid: int | None = None, delay_s: float = 0.0) -> None:  # fmt: skip
        """Count calls that took ``wall_s`` and ``cpu_s`` seconds in all, ``delay_s`` of them
        waiting for a core.

        ``start`` (on ``perf_counter``'s clock), ``where`` and ``pid`` say where a call that ran in
        a worker process ran, for a trace; without them the call ran on this thread, just now.
        """
        with self._lock:
            self.calls += calls
            self.work_s += wall_s
            self.cpu_s += cpu_s
            self.delay_s += delay_s
            self.items += items
        if self.trace is not None:
            self.trace.call(wall_s, start, where, pid)

    def add_call(self, clock: CallClock, items: int = 0) -> None:
        """Count one call that ran on this thread since ``clock`` was started."""
        wall_s, cpu_s, delay_s = clock.spent()
        self.add(wall_s, cpu_s, items=items, delay_s=delay_s)

    def add_items(self, items: int) -> None:
        """Count ``items`` elements read by calls already added (a chunk that just arrived)."""
        with self._lock:
            self.items += items

    def totals(self) -> tuple[int, float, float]:
        """``(calls, work_s, cpu_s)`` read together."""
        with self._lock:
            return self.calls, self.work_s, self.cpu_s


class CallClock:
    """This thread's clocks at the start of a call: wall time, CPU time and, unless ``delay`` is
    False, run delay (two reads of a file a call, ~8 us: a call on the consumer's thread, which
    no model reads it for, does without)."""

    __slots__ = ("wall", "cpu", "delay")

    def __init__(self, delay: bool = True) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        self.delay = run_delay() if delay else None

    def spent(self) -> tuple[float, float, float]:
        """``(wall_s, cpu_s, delay_s)`` since the start (delay 0 where not read, or where the
        kernel does not tell)."""
        delay = run_delay() if self.delay is not None else None
        delay_s = delay - self.delay if delay is not None and self.delay is not None else 0.0
        return time.perf_counter() - self.wall, time.thread_time() - self.cpu, delay_s


SAMPLED_BELOW_S = 1e-3
"""Calls on the consumer's thread shorter than this are clocked one in :data:`SAMPLE_EVERY`: a
clock costs ~2.5 us (two reads of the thread's CPU clock), 1-2% of a cheap DataLoader batch."""
SAMPLE_EVERY = 16
_LOG_SKIP = math.log(1.0 - 1.0 / SAMPLE_EVERY)


class SampledCalls:
    """Calls run one after another on one thread, clocked one in a few where cheap.

    After a call under :data:`SAMPLED_BELOW_S`, each call is clocked with a chance of one in
    :data:`SAMPLE_EVERY` (the gap drawn at once, geometric, from a generator of its own) and
    counts that many times; after a dearer one, the next is clocked. Each call's chance is fixed
    before it runs, so the totals are unbiased; the call count is exact at every clocked call
    (the calls in between are added with it). An unclocked call is timed on the wall clock alone
    (~0.1 us): one that turns out dear ends the gap, so calls whose cost grows are clocked from
    the next one on. A traced pass clocks every call.

    Args:
        timing: where the calls are added.
        seed: the gaps' generator's seed.
    """

    __slots__ = ("timing", "_gaps", "_skip", "_skipped", "_weight")

    def __init__(self, timing: CallTiming, seed: int = 0x5EED) -> None:
        self.timing = timing
        self._gaps = random.Random(seed)
        self._skip = 0  # calls to run before the next clocked one
        self._skipped = 0  # calls run unclocked since the last one added
        self._weight = 1

    def run(self, handler: Callable[[int, Any], Any], seq: int, payload: Any) -> Any:
        """``handler(seq, payload)``, clocked or not; its exception propagates."""
        if self._skip and self.timing.trace is None:
            self._skip -= 1
            self._skipped += 1
            started = time.perf_counter()
            try:
                return handler(seq, payload)
            finally:
                if time.perf_counter() - started >= SAMPLED_BELOW_S:
                    self._skip, self._weight = 0, 1  # dear now: the next call is clocked, and counts once
        clock = CallClock(delay=False)
        try:
            return handler(seq, payload)
        finally:
            self._add(clock)

    def _add(self, clock: CallClock) -> None:
        """Add the clocked call (and those run unclocked before it), and choose the next to clock."""
        wall_s, cpu_s, _ = clock.spent()
        weight = self._weight
        self.timing.add(wall_s * weight, cpu_s * weight, calls=self._skipped + 1)
        self._skipped = 0
        if wall_s >= SAMPLED_BELOW_S:
            self._weight, self._skip = 1, 0
        else:
            self._weight = SAMPLE_EVERY
            self._skip = int(math.log(1.0 - self._gaps.random()) / _LOG_SKIP)

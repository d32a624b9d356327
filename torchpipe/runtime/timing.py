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

    def add(
        self,
        wall_s: float,
        cpu_s: float,
        calls: int = 1,
        items: int = 0,
        start: float | None = None,
        where: str | None = None,
        pid: int | None = None,
        delay_s: float = 0.0,
    ) -> None:
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


_WAITS = threading.local()  # per thread: seconds calls waited for another call (see waited())


def waited(seconds: float) -> None:
    """Count ``seconds`` this thread just spent inside a call waiting for another call to end
    (a process interleave's next chunk, for the chunk before it on another thread): a
    :class:`CallClock` running on this thread leaves them out of the call's wall time, which
    is what the call cost, not how long it stood in line."""
    _WAITS.s = getattr(_WAITS, "s", 0.0) + seconds


class CallClock:
    """This thread's clocks at the start of a call: wall time, CPU time and, unless ``delay`` is
    False, run delay (two reads of a file a call, ~8 us: a call on the consumer's thread, which
    no model reads it for, does without). The wall time leaves out what the call said it
    :func:`waited` for another call."""

    __slots__ = ("wall", "cpu", "delay", "waits")

    def __init__(self, delay: bool = True) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        self.delay = run_delay() if delay else None
        self.waits = getattr(_WAITS, "s", 0.0)

    def spent(self) -> tuple[float, float, float]:
        """``(wall_s, cpu_s, delay_s)`` since the start (delay 0 where not read, or where the
        kernel does not tell)."""
        delay = run_delay() if self.delay is not None else None
        delay_s = delay - self.delay if delay is not None and self.delay is not None else 0.0
        wall_s = time.perf_counter() - self.wall - self.waited_s()
        return wall_s, time.thread_time() - self.cpu, delay_s

    def waited_s(self) -> float:
        """Seconds the call said it :func:`waited` since the start."""
        return getattr(_WAITS, "s", 0.0) - self.waits


SAMPLED_BELOW_S = 1e-3
"""Calls on the consumer's thread shorter than this read the CPU clock one in :data:`SAMPLE_EVERY`
(two reads of it cost ~1.5 us, 1% of a cheap DataLoader batch)."""
SAMPLE_EVERY = 16
_LOG_SKIP = math.log(1.0 - 1.0 / SAMPLE_EVERY)


class SampledCalls:
    """Calls run one after another on one thread: every call's wall time, their CPU time sampled.

    The wall clock is read around every call (~0.1 us): a window's wall time per call, which a
    placement judges by, is exact, and a busy moment counts once. The CPU clock is read around
    one call in :data:`SAMPLE_EVERY` after a call under :data:`SAMPLED_BELOW_S` (the gap drawn
    at once, geometric, from a generator of its own; the call's CPU time counts that many
    times), around every call after a dearer one. Each call's chance is fixed before it runs, so
    the CPU total is unbiased. The calls are added at each call whose CPU clock was read (with
    those before it); a call that turns out dear ends the gap. A traced pass reads every call.

    Args:
        timing: where the calls are added.
        seed: the gaps' generator's seed.
    """

    __slots__ = ("timing", "_gaps", "_skip", "_calls", "_wall_s", "_weight")

    def __init__(self, timing: CallTiming, seed: int = 0x5EED) -> None:
        self.timing = timing
        self._gaps = random.Random(seed)
        self._skip = 0  # calls to run before the next whose CPU time is read
        self._calls = 0  # calls run since the last added, and their wall time
        self._wall_s = 0.0
        self._weight = 1

    def run(self, handler: Callable[[int, Any], Any], seq: int, payload: Any) -> Any:
        """``handler(seq, payload)``, timed; its exception propagates."""
        sampled = not self._skip or self.timing.trace is not None
        cpu0 = time.thread_time() if sampled else 0.0
        started = time.perf_counter()
        try:
            return handler(seq, payload)
        finally:
            wall_s = time.perf_counter() - started
            self._calls += 1
            self._wall_s += wall_s
            if sampled:
                self._add((time.thread_time() - cpu0) * self._weight, wall_s)
            else:
                self._skip -= 1
                if wall_s >= SAMPLED_BELOW_S:
                    self._skip, self._weight = (
                        0,
                        1,
                    )  # dear now: the next call is read, and counts once

    def _add(self, cpu_s: float, wall_s: float) -> None:
        """Add the calls since the last added, and choose the next call to read."""
        self.timing.add(self._wall_s, cpu_s, calls=self._calls)
        self._calls, self._wall_s = 0, 0.0
        if wall_s >= SAMPLED_BELOW_S:
            self._weight, self._skip = 1, 0
        else:
            self._weight = SAMPLE_EVERY
            self._skip = int(math.log(1.0 - self._gaps.random()) / _LOG_SKIP)

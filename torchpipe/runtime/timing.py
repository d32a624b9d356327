"""What a pool measures of the calls it runs: how many, their wall and CPU seconds, and how long
they waited for a core."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

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

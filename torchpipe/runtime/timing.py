"""What a pool measures of the calls it runs: how many, and their wall and CPU seconds."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchpipe.observe.tracing import CallTracer


class CallTiming:
    """Totals over the calls a stage ran on pool threads or worker processes; thread-safe.

    ``work_s`` is each call's wall time (what the call cost its thread or worker, waits on I/O
    included), ``cpu_s`` its CPU time; their ratio tells compute from waiting. ``items`` counts
    the elements the calls read, for stages that read ahead of their consumer (interleaves, whose
    calls are one read or a chunk of them); 0 where a stage does not count them.
    """

    __slots__ = ("_lock", "calls", "work_s", "cpu_s", "items", "trace")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.work_s = 0.0
        self.cpu_s = 0.0
        self.items = 0
        self.trace: CallTracer | None = None  # set when the pass is traced (Options(trace=...))

    def add(self, wall_s: float, cpu_s: float, calls: int = 1, items: int = 0, start: float | None = None,
            where: str | None = None, pid: int | None = None) -> None:  # fmt: skip
        """Count calls that took ``wall_s`` and ``cpu_s`` seconds in all.

        ``start`` (on ``perf_counter``'s clock), ``where`` and ``pid`` say where a call that ran in
        a worker process ran, for a trace; without them the call ran on this thread, just now.
        """
        with self._lock:
            self.calls += calls
            self.work_s += wall_s
            self.cpu_s += cpu_s
            self.items += items
        if self.trace is not None:
            self.trace.call(wall_s, start, where, pid)

    def add_items(self, items: int) -> None:
        """Count ``items`` elements read by calls already added (a chunk that just arrived)."""
        with self._lock:
            self.items += items

    def totals(self) -> tuple[int, float, float]:
        """``(calls, work_s, cpu_s)`` read together."""
        with self._lock:
            return self.calls, self.work_s, self.cpu_s

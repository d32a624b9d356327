"""Executors run ``handler(seq, payload)`` tasks and hand back results as they complete.

Parallel ops talk to every executor the same way, through a
:class:`~torchpipe.runtime.dispatch.Dispatcher`: ``submit`` tasks up to ``capacity``, then
``collect`` the finished ones as ``(seq, value, error)``. There are four: :class:`InlineExecutor`
(the consumer's own thread), :class:`ThreadExecutor`, the process pool
(:class:`~torchpipe.runtime.processes.pool.ProcessPool`) and the Ray actor pool
(:class:`~torchpipe.runtime.ray.pool.RayActorPool`); the two pools route tasks to their workers
through one :class:`~torchpipe.runtime.routing.TaskRouter`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from torchpipe.runtime.thread_pool import ThreadPool
from torchpipe.runtime.timing import CallClock, CallTiming, SampledCalls

Result = tuple[int, Any, "BaseException | None"]


class Executor(Protocol):
    """What a parallel op needs from a pool of threads or processes."""

    @property
    def capacity(self) -> int:
        """How many tasks may be in flight at once."""

    @property
    def size(self) -> int:
        """The number of threads or processes."""

    timing: CallTiming
    """The calls run so far: count, wall and CPU seconds."""

    def submit(self, seq: int, payload: Any) -> None:
        """Queue ``handler(seq, payload)``."""

    def collect(self, timeout: float) -> list[Result]:
        """Results finished since the last call; waits up to ``timeout`` s for the first one."""

    def resize(self, size: int) -> None:
        """Change the number of threads or processes while running."""

    def holds(self, seq: int) -> bool:
        """Whether task ``seq`` was submitted here and its result not yet collected."""

    def where(self, seq: int) -> str:
        """Where task ``seq`` runs, for errors: a thread's name, a worker's pid."""

    def close(self) -> None:
        """Stop all work; idempotent."""


class InlineExecutor:
    """Runs each task at once, on the thread that submits it: no hand-off, nothing copied.

    For calls cheaper than moving their results; ``capacity`` is 1, so a stage on it computes one
    element when its consumer asks for one.

    Args:
        handler: ``handler(seq, payload) -> value``.
        timing: where the calls' costs are added up.
    """

    capacity = 1
    size = 0

    def __init__(
        self, handler: Callable[[int, Any], Any], timing: CallTiming | None = None
    ) -> None:
        self._handler = handler
        self._results: list[Result] = []
        self.timing = timing if timing is not None else CallTiming()
        self._clocks = SampledCalls(self.timing)

    def submit(self, seq: int, payload: Any) -> None:
        try:
            self._results.append((seq, self.call(seq, payload), None))
        except Exception as e:  # noqa: BLE001 - delivered in its place, like a worker's
            self._results.append((seq, None, e))

    def call(self, seq: int, payload: Any) -> Any:
        """Run task ``seq`` now and return its value (its exception propagates), timed: for a
        stage that needs no dispatch because nothing else is in flight. Cheap calls are clocked
        one in a few (:class:`~torchpipe.runtime.timing.SampledCalls`), and their run delay is
        not read: calls on the consumer's thread are no pool the tuner models."""
        return self._clocks.run(self._handler, seq, payload)

    def collect(self, timeout: float) -> list[Result]:
        results, self._results = self._results, []
        return results

    def resize(self, size: int) -> None:
        """Nothing to resize: calls run on the caller's thread."""

    def holds(self, seq: int) -> bool:
        return any(done == seq for done, _, _ in self._results)

    def where(self, seq: int) -> str:
        return "the consumer's thread"

    def close(self) -> None:
        self._results.clear()


class ThreadExecutor:
    """Runs tasks on a :class:`ThreadPool`; no serialization, shares the GIL.

    Args:
        handler: ``handler(seq, payload) -> value``.
        size: number of threads.
        name: thread-name prefix.
        timing: where the calls' costs are added up.
    """

    def __init__(
        self,
        handler: Callable[[int, Any], Any],
        size: int,
        name: str,
        timing: CallTiming | None = None,
    ) -> None:
        self._handler = handler
        self._pool = ThreadPool(size, name)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[int, str] = {}  # seq -> the thread running it ("" while queued)
        self.timing = timing if timing is not None else CallTiming()

    @property
    def capacity(self) -> int:
        return self._pool.size

    @property
    def size(self) -> int:
        return self._pool.size

    def submit(self, seq: int, payload: Any) -> None:
        finished = self._finished
        self._in_flight[seq] = ""
        future = self._pool.submit(self._timed, seq, payload)
        future.add_done_callback(lambda f: finished.put((seq, f)))

    def collect(self, timeout: float) -> list[Result]:
        try:
            items = [self._finished.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._finished.get_nowait())
            except queue.Empty:
                for seq, _ in items:
                    self._in_flight.pop(seq, None)
                return [_unpack(seq, future) for seq, future in items if not future.cancelled()]

    def holds(self, seq: int) -> bool:
        return seq in self._in_flight

    def where(self, seq: int) -> str:
        thread = self._in_flight.get(seq)
        return f"thread {thread}" if thread else "a thread pool's queue"

    def _timed(self, seq: int, payload: Any) -> Any:
        if seq in self._in_flight:
            self._in_flight[seq] = threading.current_thread().name
        clock = CallClock()
        try:
            return self._handler(seq, payload)
        finally:
            self.timing.add_call(clock)

    def resize(self, size: int) -> None:
        self._pool.resize(size)

    def close(self) -> None:
        self._pool.close()
        self._in_flight.clear()


def _unpack(seq: int, future: Future) -> Result:
    error = future.exception()
    return (seq, None, error) if error is not None else (seq, future.result(), None)

"""Executors run ``handler(seq, payload)`` tasks and hand back results as they complete.

Parallel ops talk to every executor the same way: ``submit`` tasks up to ``capacity``, then
``collect`` the finished ones as ``(seq, value, error)``. Ordering is the op's business.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from torchpipe.runtime.thread_pool import ThreadPool
from torchpipe.runtime.timing import CallTiming

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

    def close(self) -> None:
        """Stop all work; idempotent."""


class ThreadExecutor:
    """Runs tasks on a :class:`ThreadPool`; no serialization, shares the GIL.

    Args:
        handler: ``handler(seq, payload) -> value``.
        size: number of threads.
        name: thread-name prefix.
        timing: where the calls' costs are added up.
    """

    def __init__(
        self, handler: Callable[[int, Any], Any], size: int, name: str, timing: CallTiming | None = None
    ) -> None:
        self._handler = handler
        self._pool = ThreadPool(size, name)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self.timing = timing if timing is not None else CallTiming()

    @property
    def capacity(self) -> int:
        return self._pool.size

    @property
    def size(self) -> int:
        return self._pool.size

    def submit(self, seq: int, payload: Any) -> None:
        finished = self._finished
        future = self._pool.submit(self._timed, seq, payload)
        future.add_done_callback(lambda f, seq=seq: finished.put((seq, f)))

    def collect(self, timeout: float) -> list[Result]:
        try:
            items = [self._finished.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._finished.get_nowait())
            except queue.Empty:
                return [_unpack(seq, future) for seq, future in items if not future.cancelled()]

    def _timed(self, seq: int, payload: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._handler(seq, payload)
        finally:
            self.timing.add(time.perf_counter() - wall, time.thread_time() - cpu)

    def resize(self, size: int) -> None:
        self._pool.resize(size)

    def close(self) -> None:
        self._pool.close()


def _unpack(seq: int, future: Future) -> Result:
    error = future.exception()
    return (seq, None, error) if error is not None else (seq, future.result(), None)

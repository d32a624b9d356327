"""A resizable pool of daemon threads: the thread executor of parallel ops."""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torchpipe.runtime.cpu import one_intra_op_thread
from torchpipe.runtime.heap import give_back_arena

_POLL_S = 0.5
_JOIN_S = 2.0  # close() waits this long in all for running calls to return
_LIVE: weakref.WeakSet[ThreadPool] = weakref.WeakSet()  # closed at interpreter exit (see close())


class ThreadPool:
    """Runs submitted calls on daemon threads; ``resize`` grows or shrinks it while it runs.

    Daemon threads never keep the interpreter alive, and a pool that is garbage-collected
    without ``close()`` still stops its threads.

    Args:
        size: number of threads (>= 1).
        name: thread-name prefix, shown in debuggers and ``py-spy``.
    """

    def __init__(self, size: int, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._size = 0
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(self, self._stopped.set)
        self.resize(size)
        _LIVE.add(self)

    @property
    def size(self) -> int:
        return self._size

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a pool thread; the Future holds its result or exception."""
        if self._stopped.is_set():
            raise RuntimeError(f"{self._name}: thread pool is closed")
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def resize(self, size: int) -> None:
        """Grow by starting threads, or shrink by asking idle ones to exit."""
        if size < 1:
            raise ValueError(f"thread pool size must be >= 1, got {size}")
        for i in range(self._size, size):
            thread = threading.Thread(
                target=_work,
                args=(self._tasks, self._stopped),
                name=f"{self._name}-{i}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._threads = [t for t in self._threads if t.is_alive()]
        for _ in range(size, self._size):
            self._tasks.put(None)
        self._size = size

    def close(self, wait: bool = True) -> None:
        """Stop the threads once their current call returns, and wait for that (up to
        ``_JOIN_S``) unless told not to; queued calls are cancelled.

        Waiting matters at interpreter exit: a daemon thread still inside a torch op when the
        process tears down its C++ thread pools aborts the process. A pool left while the
        process goes on (an interleave's readers moving to worker processes) need not wait.
        """
        self._finalizer()
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._tasks.put(None)  # wake idle threads now rather than at their next poll
        if not wait:
            return
        deadline = time.monotonic() + _JOIN_S
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _work(tasks: queue.SimpleQueue, stopped: threading.Event) -> None:
    one_intra_op_thread()
    try:
        _serve(tasks, stopped)
    finally:
        give_back_arena()  # what its calls made and freed stays in its arena otherwise


def _serve(tasks: queue.SimpleQueue, stopped: threading.Event) -> None:
    while not stopped.is_set():
        try:
            item = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if item is None:
            return
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the consumer, not swallowed
            future.set_exception(e)


@atexit.register
def _close_live_pools() -> None:
    """Pools of iterators still open at exit (a loop left with ``break``) stop before the
    interpreter tears down torch: a thread inside a torch op then would abort the process."""
    for pool in list(_LIVE):
        pool.close()

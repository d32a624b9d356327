"""``ForkSafeLock`` (``torchpipe/runtime/forks.py``): held by another thread at a fork, it is free
in the child; in the parent it stays a plain lock."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torchpipe.runtime.forks import ForkSafeLock


def in_child(check: Callable[[], bool]) -> int:
    """Fork; run ``check()`` in the child (killed by SIGALRM if it hangs); its exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(10)
        try:
            os._exit(0 if check() else 1)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return status


@contextlib.contextmanager
def held_by_another_thread(lock: Any) -> Iterator[None]:
    """Within the block, another thread holds ``lock`` (as one that was inside it at a fork)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join()


def test_a_lock_held_by_another_thread_at_the_fork_is_free_in_the_child():
    lock = ForkSafeLock()

    def take() -> bool:
        with lock:
            return True

    with held_by_another_thread(lock):
        assert lock.locked()
        status = in_child(take)
    assert status == 0, status  # exited 0: took the lock (not killed by the alarm)
    assert not lock.locked()
    with lock:
        assert lock.locked()

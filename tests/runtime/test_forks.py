"""``ForkSafeLock`` (``torchpipe/runtime/forks.py``): held by another thread at a fork, it is free
in the child; in the parent it stays a plain lock."""

from __future__ import annotations

import threading

from tests.runtime.test_local_files import _in_child
from torchpipe.runtime.forks import ForkSafeLock


def test_a_lock_held_by_another_thread_at_the_fork_is_free_in_the_child():
    lock = ForkSafeLock()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    try:
        assert lock.locked()

        def take() -> bool:
            with lock:
                return True

        status = _in_child(take)
    finally:
        release.set()
        thread.join()
    assert status == 0, status  # exited 0: took the lock (not killed by the alarm)
    assert not lock.locked()
    with lock:
        assert lock.locked()

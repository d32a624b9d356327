"""A lock that a forked child gets unlocked.

A lock that another thread holds at the moment of a ``fork`` stays held in the child, where that
thread does not exist, so the child's first ``with lock:`` waits forever. Worker processes are
forked from the main process (through the zygote, or by torch's DataLoader) while its threads
may be inside such a lock: a DataLoader that moved its reads from threads to worker processes
hung in its workers' first file open so. Locks that code in a worker may take are
:class:`ForkSafeLock` s: every one is replaced by a fresh lock in the child, while it still has
one thread (``os.register_at_fork``). What the lock guarded is as the parent left it; each owner
says why that is safe (a table of this process's descriptors starts empty, a count goes on).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any


class ForkSafeLock:
    """A ``threading.Lock`` (``with`` only) that is unlocked in a forked child."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _renew(self) -> None:
        self._lock = threading.Lock()


_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_LOCKS):
        lock._renew()


os.register_at_fork(after_in_child=_after_fork_in_child)

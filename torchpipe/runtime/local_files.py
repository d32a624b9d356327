"""Read-only descriptors of local files, opened once in each process that reads them.

Fork-safe: a process forked while one of its threads was opening a file (the lock held, by a
thread the child does not have) starts with a fresh lock and an empty table, so the child opens
its own descriptors instead of waiting forever (a DataLoader that moved its reads from threads to
worker processes hung so).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

_TABLES: weakref.WeakSet[ProcessLocalFiles] = weakref.WeakSet()


class ProcessLocalFiles:
    """Read-only descriptors of local files, opened on first use in each process (a forked
    worker opens its own) and closed when the owner is collected."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        _TABLES.add(self)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # descriptors belong to a process: a copy elsewhere opens its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]  # this class's own __init__: a fresh, empty table

    def descriptor(self, key: int, path: str) -> int:
        fd = self._fds.get(key) if self._pid == os.getpid() else None
        if fd is not None:
            return fd
        with self._lock:
            if self._pid != os.getpid():  # forked without os.fork's hooks (see _after_fork)
                self._pid, self._fds = os.getpid(), {}  # inherited descriptors stay the parent's to close
            if key not in self._fds:
                self._fds[key] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._fds[key]

    def _forked(self) -> None:
        """In a child just forked (one thread): a lock of its own and no descriptors yet."""
        self._pid, self._fds, self._lock = os.getpid(), {}, threading.Lock()

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass


def _after_fork() -> None:
    for table in list(_TABLES):
        table._forked()


os.register_at_fork(after_in_child=_after_fork)

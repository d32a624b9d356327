"""Read-only descriptors of local files, opened once in each process that reads them."""

from __future__ import annotations

import os
from typing import Any

from torchpipe.runtime.forks import ForkSafeLock


class ProcessLocalFiles:
    """Read-only descriptors of local files, opened on first use in each process (a forked
    worker opens its own, even when another thread was opening one at the fork: the lock is a
    :class:`~torchpipe.runtime.forks.ForkSafeLock`) and closed when the owner is collected."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[int, int] = {}
        self._lock = ForkSafeLock()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # descriptors belong to a process: a copy elsewhere opens its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]  # this class's own __init__: a fresh, empty table

    def descriptor(self, key: int, path: str) -> int:
        fd = self._fds.get(key) if self._pid == os.getpid() else None
        if fd is not None:
            return fd
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._fds = (
                    os.getpid(),
                    {},
                )  # inherited descriptors stay the parent's to close
            if key not in self._fds:
                self._fds[key] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._fds[key]

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass

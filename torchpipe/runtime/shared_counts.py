"""Counts that every forked process adds to and the main process reads.

A user function may count something the pipeline should report (``tp.image`` counts the images it
decoded and those its fast decoder refused), and it may run inline, on a thread or in a worker
process. The counts live in one anonymous shared mapping made when torchpipe is imported, so
every process forked after that (the zygote, its worker processes, torch's own fork workers)
adds to the same numbers; a process started another way (spawn, forkserver) counts in its own
copy, which the main process does not see. Nothing is named in /dev/shm.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing

NAMES = ("images_decoded", "images_fallback")
"""The counts kept: images decoded by ``tp.image``, and of those the ones decoded by Pillow
because the fast decoder refused them."""


class SharedCounts:
    """Named int64 counts in shared memory, added to under a process-shared lock."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._index = {name: i for i, name in enumerate(names)}
        self._map = mmap.mmap(-1, 8 * len(names))  # anonymous and MAP_SHARED: forked children share it
        self._values = (ctypes.c_int64 * len(names)).from_buffer(self._map)
        self._lock = multiprocessing.Lock()

    def add(self, name: str, n: int = 1) -> None:
        i = self._index[name]
        with self._lock:
            self._values[i] += n

    def snapshot(self) -> dict[str, int]:
        """Every count now."""
        with self._lock:
            return {name: int(self._values[i]) for name, i in self._index.items()}


COUNTS = SharedCounts(NAMES)


def since(start: dict[str, int]) -> dict[str, int]:
    """What each count grew by since ``start`` (a :meth:`SharedCounts.snapshot`)."""
    now = COUNTS.snapshot()
    return {name: now[name] - start.get(name, 0) for name in now}

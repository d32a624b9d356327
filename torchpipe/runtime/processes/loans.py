"""A worker's ring as the main process reads it: records lent out as the memory of decoded tensors.

A result decoded from a ring record views the record (no copy); the record goes back to the ring
once the last tensor or array viewing it is freed, in the order the ring wants them.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import numpy as np

from torchpipe.runtime.processes.shm_ring import ShmRing


class RingLoans:
    """Records of one ring lent out as the memory of decoded tensors and arrays.

    A record is returned when the last tensor or array viewing it is freed (in whatever thread
    that happens); the ring wants its records back in order, so a record returned early waits
    for the older ones.
    """

    def __init__(self, ring: ShmRing) -> None:
        self._ring = ring
        self._lock = threading.Lock()
        self._out: deque[tuple[int, int]] = deque()
        self._returned: set[int] = set()

    def lend(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 array over the record; the record is returned when it is freed."""
        with self._lock:
            view = self._ring.view(offset, nbytes, writable=True)
            self._out.append((offset, nbytes))
        base = np.frombuffer(view, np.uint8)
        weakref.finalize(base, self._give_back, offset)
        return base

    @property
    def lent(self) -> int:
        """Records lent out and not yet back in the ring (one freed early waits for the older)."""
        return len(self._out)

    @property
    def ring(self) -> ShmRing:
        return self._ring

    def close(self) -> None:
        """Close the ring (under the lock: a finalizer may be releasing on another thread)."""
        with self._lock:
            self._ring.close()

    def _give_back(self, offset: int) -> None:
        with self._lock:
            self._returned.add(offset)
            while self._out and self._out[0][0] in self._returned:
                oldest, nbytes = self._out.popleft()
                self._returned.discard(oldest)
                if not self._ring.closed:
                    self._ring.release(oldest, nbytes)

"""A DataLoader's RAM budget: what its workers hold, measured, against the budget.

``tp.DataLoader(..., autotune=tp.AutotuneOptions(ram_budget=...))`` bounds the memory the loader
adds to the process tree: the pages its worker processes (and their zygote) hold alone, and the
rings batches travel in (a batch this process has received is its own, as with torch's
workers). A model of it would miss what matters (a worker's heap after its first batches, what
the zygote keeps of pages this process rewrote since), so it is read from
``/proc/<pid>/smaps_rollup`` a few times a second; where it exceeds the budget the loader gives
up a worker (the last one: its batches are made in this process, which holds nothing more).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

CHECK_EVERY_S = 0.25
"""How often the loader's memory is read (a process's pages cost ~0.1 ms to read)."""
MIN_RING_BYTES = 1 << 20
"""The least a worker's rings may hold under a budget (results beyond take one-off segments)."""
_PRIVATE = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")


def private_bytes(pid: int) -> int:
    """The pages process ``pid`` holds alone (its USS), in bytes; 0 where it is gone or unreadable.
    A forked worker shares every page it has not written with the process it was forked from:
    those cost nothing more."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith(_PRIVATE))
    except OSError:
        return 0


def ring_limit(ram_budget: float, workers: int) -> int:
    """The most a worker's rings may hold under ``ram_budget``: a quarter of the budget shared by
    the ``workers`` there may be (results beyond travel in one-off segments, freed once used)."""
    return max(MIN_RING_BYTES, int(ram_budget / (4 * max(workers, 1))))


class LoaderMemory:
    """Reads what a loader holds, at most every :data:`CHECK_EVERY_S`, against ``budget`` bytes.

    Args:
        budget: the loader's RAM budget in bytes.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.held = 0.0  # the last reading
        self._due = 0.0

    def over(self, pids: Iterable[int], rings_bytes: float) -> bool:
        """Whether the loader holds more than its budget: the pages its processes ``pids`` hold
        alone (a batch a worker has made and not handed over among them) and the workers' rings
        (``rings_bytes`` in all, shared with this process). Reads at most every
        :data:`CHECK_EVERY_S`; False in between."""
        now = time.monotonic()
        if now < self._due:
            return False
        self._due = now + CHECK_EVERY_S
        self.held = sum(private_bytes(pid) for pid in pids) + rings_bytes
        return self.held > self.budget

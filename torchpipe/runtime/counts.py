"""Counts that user functions keep (``tp.image``'s decodes), gathered where the pipeline reports them.

A user function may run inline, on a thread, or in a worker process. Counts made in this process
add to its totals. A worker process runs each task under a tally of its own (:meth:`Counts.tally`),
which travels back with the task's result and is added to the main process's totals
(:meth:`Counts.add_tally`): no lock is shared between processes, so a worker killed mid-task loses
that task's counts and nothing else. Counts made by torch's own DataLoader workers or on Ray
actors stay there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torchpipe.runtime.forks import ForkSafeLock

NAMES = ("images_decoded", "images_fallback")
"""The counts kept: images decoded by ``tp.image``, and of those the ones decoded by Pillow
because the fast decoder refused them."""

Tally = dict[str, int]


class Counts:
    """Named counts of this process, and per-thread tallies for tasks run for another process."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._totals = dict.fromkeys(names, 0)
        self._lock = ForkSafeLock()  # a worker forked mid-count counts on
        self._local = threading.local()

    def add(self, name: str, n: int = 1) -> None:
        tally = getattr(self._local, "tally", None)
        if tally is not None:
            tally[name] = tally.get(name, 0) + n
            return
        with self._lock:
            self._totals[name] += n

    def snapshot(self) -> dict[str, int]:
        """Every count of this process now."""
        with self._lock:
            return dict(self._totals)

    @contextlib.contextmanager
    def tally(self) -> Iterator[Tally]:
        """Within the block, what this thread counts goes to the yielded tally instead of the totals."""
        previous = getattr(self._local, "tally", None)
        tally: Tally = {}
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = previous

    def add_tally(self, tally: Tally | None) -> None:
        """Add what a task counted elsewhere (a worker process's :meth:`tally`)."""
        if tally:
            with self._lock:
                for name, n in tally.items():
                    self._totals[name] = self._totals.get(name, 0) + n


COUNTS = Counts(NAMES)

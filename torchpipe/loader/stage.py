"""A DataLoader's worker iterator as the autotuner and ``loader.stats()`` see it.

:class:`WorkersStage` is the one pool stage of :class:`~torchpipe.loader.workers.WorkerIterator`
(no input): its knob, its parallelism and in-flight batches, and where its batches are made;
:func:`resize_weakly` is what the tuner's request for a worker count does. Both hold the iterator
weakly: the tuner's thread must not keep a dropped iterator, and its workers, alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torchpipe.core.stats import IteratorStats
from torchpipe.core.tunable import POOL, Tunable
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.policy import PROCESS

STAGE = "DataLoader workers"
NOT_ON_THREADS = (
    "the dataset draws from the global RNGs (random, numpy, torch), which threads share, and seeds were set "
    "(a generator given, or torch.manual_seed) so its draws must repeat on every run"
)
"""Why ``num_workers="auto"`` makes no batch on threads, in ``loader.stats()``."""


class WorkersStage(Tunable):
    """A DataLoader's batches as the autotuner and the report see them: one pool stage, no input.

    It counts the batches delivered (and the loop's waits) in the iterator stats every op keeps;
    the time per batch comes from the executors' call timing.
    """

    name = STAGE
    tuning_role = POOL

    def __init__(self, iterator: Any) -> None:
        self.stats = IteratorStats()
        self._iterator = weakref.ref(iterator)

    def children(self) -> list[Any]:
        return []

    def knobs(self) -> list[LiveKnob]:
        it = self._iterator()
        return [it._knob] if it is not None and it._knob is not None else []

    def parallelism(self) -> int:
        it = self._iterator()
        if it is None:
            return 0
        return it._placement.workers if it._placement is not None else it._pool.size

    def buffer_slots(self) -> int:
        it = self._iterator()
        return it._window() if it is not None else 0

    def calls_in_processes(self) -> bool:
        it = self._iterator()
        return it is not None and (it._placement is None or it._placement.kind == PROCESS)

    def executor_report(self) -> dict[str, Any]:
        """Where batches are made, for ``loader.stats()``, as a parallel map reports it: the
        ``executor`` kind, its ``workers``, the worker processes' ``pids`` and, with
        ``num_workers="auto"``, what its policy measured (``policy``: :meth:`Policy.report`)."""
        it = self._iterator()
        if it is None:
            return {}
        kind = it._placement.kind if it._placement is not None else PROCESS
        report: dict[str, Any] = {
            "executor": kind,
            "workers": self.parallelism(),
            "pids": it._pool.pids,
        }
        policy = it._placement.policy if it._placement is not None else None
        if policy is not None:
            report["measured"] = sorted(policy.measured)
            report["policy"] = policy.report()
            if policy.costs is not None and not policy.costs.thread_safe:
                report["not_on_threads"] = NOT_ON_THREADS
        return report


def resize_weakly(iterator: Any) -> Callable[[int], None]:
    """What the tuner's request for a worker count (0: batches made in this process) does; it
    holds the iterator weakly (the tuner's thread must not keep a dropped iterator, and its
    workers, alive)."""
    ref = weakref.ref(iterator)

    def apply(n: int) -> None:
        live = ref()
        if live is not None:
            assert live._placement is not None  # the knob exists with num_workers="auto"
            live._placement.resize(n)
            live._fill()

    return apply

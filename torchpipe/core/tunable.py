"""The autotuner's view of a stage: :class:`Tunable`, which the iterators the autotuner models declare.

Most iterators run on their caller's thread and need nothing: the model takes their self time
from the stats every iterator keeps. An iterator that runs calls on a pool (``tuning_role ==
"pool"``: parallel map, parallel interleave, the DataLoader's batches) or fills a buffer from a
thread of its own (``"buffer"``: prefetch) subclasses :class:`Tunable`. It lives in the core, not
in ``autotune/``, because imports point down: the ops declare it and the autotuner, above them,
reads it (``autotune/tunable.py``).
"""

from __future__ import annotations

import abc
from typing import Any

from torchpipe.core.stats import IteratorStats
from torchpipe.runtime.knob import LiveKnob

POOL, BUFFER = "pool", "buffer"


class Tunable(abc.ABC):
    """A stage the autotuner models as more than its caller's thread.

    Attributes:
        name: the stage's name.
        stats: its counters (``stats.calls`` for a pool: what its calls cost where they ran).
        tuning_role: ``"pool"`` or ``"buffer"``; None on an instance that turned out to run on
            its caller's thread after all (an interleave whose readers read inline).
    """

    name: str
    stats: IteratorStats
    tuning_role: str | None

    @abc.abstractmethod
    def children(self) -> list[Any]:
        """The stages it pulls from."""

    @abc.abstractmethod
    def knobs(self) -> list[LiveKnob]:
        """The values the autotuner may change while it runs (those set to AUTOTUNE)."""

    @abc.abstractmethod
    def buffer_slots(self) -> int:
        """Elements it can hold ready or in flight for its consumer."""

    @abc.abstractmethod
    def parallelism(self) -> int:
        """Threads or processes running its calls at once (0: on the caller's thread)."""

    @abc.abstractmethod
    def calls_in_processes(self) -> bool:
        """Whether its calls run in worker processes (their CPU is not this process's)."""

    def calls_on_cluster(self) -> bool:
        """Whether its calls run on a cluster's CPUs (Ray actors), which the machine's CPU budget
        does not count (default: no)."""
        return False

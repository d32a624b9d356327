"""The autotuner's view of a stage: the small interface an op implements to be modelled and tuned.

Most iterators run on their caller's thread and need nothing: the model takes their self time
from the stats every iterator keeps. An iterator that runs calls on a pool (``tuning_role ==
"pool"``: parallel map, parallel interleave, the DataLoader's batches) or fills a buffer from a
thread of its own (``"buffer"``: prefetch) says so and answers :class:`Tunable`. The interface is
structural: ops do not import it (imports point down, and the autotuner sits above the ops), and
the functions below give every other iterator the defaults.
"""

from __future__ import annotations

from typing import Any, Protocol

from torchpipe.core.stats import IteratorStats, LiveKnob

POOL, BUFFER = "pool", "buffer"


class Tunable(Protocol):
    """A stage the autotuner models as more than its caller's thread.

    Attributes:
        name: the stage's name.
        stats: its counters (``stats.calls`` for a pool: what its calls cost where they ran).
        tuning_role: ``"pool"`` or ``"buffer"``.
    """

    name: str
    stats: IteratorStats
    tuning_role: str

    def children(self) -> list[Any]:
        """The stages it pulls from."""

    def knobs(self) -> list[LiveKnob]:
        """The values the autotuner may change while it runs (those set to AUTOTUNE)."""

    def parallelism(self) -> int:
        """Threads or processes running its calls at once (0: on the caller's thread); pools only."""

    def buffer_slots(self) -> int:
        """Elements it can hold ready or in flight for its consumer."""

    def calls_in_processes(self) -> bool:
        """Whether its calls run in worker processes (their CPU is not this process's); pools only."""


def role(stage: Any) -> str | None:
    """``"pool"``, ``"buffer"``, or None for a stage on its caller's thread."""
    return getattr(stage, "tuning_role", None)


def knobs(stage: Any) -> list[LiveKnob]:
    """The stage's live knobs (none for a stage that is not :class:`Tunable`)."""
    return stage.knobs() if role(stage) is not None else []


def parallelism(stage: Any) -> int:
    return stage.parallelism() if role(stage) == POOL else 1


def buffer_slots(stage: Any) -> int:
    return stage.buffer_slots() if role(stage) is not None else 0


def calls_in_processes(stage: Any) -> bool:
    return role(stage) == POOL and stage.calls_in_processes()


def calls_on_cluster(stage: Any) -> bool:
    """Whether a pool's calls run on a cluster's CPUs (Ray actors), which the machine's CPU
    budget does not count: its knob's maximum is what the cluster has free."""
    return role(stage) == POOL and getattr(stage, "calls_on_cluster", lambda: False)()

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
import weakref
from collections.abc import Callable
from typing import Any, Protocol

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

    def executor_report(self) -> dict[str, Any]:
        """Where its calls run, for ``stats()`` (default: nothing to say)."""
        return {}


class StageOwner(Protocol):
    """What a :class:`WeakStage` asks of the object doing the work: the :class:`Tunable`
    contract's questions (that object keeps no ``stats`` of the stage's: the stage does)."""

    def children(self) -> list[Any]: ...
    def knobs(self) -> list[LiveKnob]: ...
    def buffer_slots(self) -> int: ...
    def parallelism(self) -> int: ...
    def calls_in_processes(self) -> bool: ...
    def executor_report(self) -> dict[str, Any]: ...


class WeakStage(Tunable):
    """A :class:`Tunable` that holds the object doing the work weakly, for the autotuner's thread:
    a stage whose owner the user drops (a DataLoader's iterator, and its worker processes) must
    not be kept alive by the tuner. It keeps the stage's counters and answers for its owner
    (:meth:`Tunable.knobs`, :meth:`~Tunable.parallelism`, ...), or nothing once the owner is gone.

    Args:
        name: the stage's name.
        tuning_role: :data:`POOL` or :data:`BUFFER`.
        owner: what answers the contract's questions while it lives.
    """

    def __init__(self, name: str, tuning_role: str, owner: StageOwner) -> None:
        self.name, self.tuning_role, self.stats = name, tuning_role, IteratorStats()
        self._owner = weakref.ref(owner)

    def children(self) -> list[Any]:
        owner = self._owner()
        return owner.children() if owner is not None else []

    def knobs(self) -> list[LiveKnob]:
        owner = self._owner()
        return owner.knobs() if owner is not None else []

    def buffer_slots(self) -> int:
        owner = self._owner()
        return owner.buffer_slots() if owner is not None else 0

    def parallelism(self) -> int:
        owner = self._owner()
        return owner.parallelism() if owner is not None else 0

    def calls_in_processes(self) -> bool:
        owner = self._owner()
        return owner is not None and owner.calls_in_processes()

    def executor_report(self) -> dict[str, Any]:
        owner = self._owner()
        return owner.executor_report() if owner is not None else {}


def weakly(method: Callable[[int], None]) -> Callable[[int], None]:
    """``method``, holding its object weakly (a no-op once it is gone): what the tuner's thread
    calls must not keep a stage's owner alive, as :class:`WeakStage`."""
    ref = weakref.WeakMethod(method)

    def call(value: int) -> None:
        live = ref()
        if live is not None:
            live(value)

    return call

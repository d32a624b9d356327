"""Where an iterator is built: :class:`BuildContext`, the source of its seeds."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

from torchpipe.core.stats import LiveKnob
from torchpipe.core.tunable import Tunable
from torchpipe.options import Options
from torchpipe.randomness import mix_seed
from torchpipe.runtime.tracing import STAGE, TraceLog

if TYPE_CHECKING:  # a node builds its iterator with a context: the three refer to each other
    from torchpipe.core.iterator import Iterator
    from torchpipe.core.node import Node

_IteratorT = TypeVar("_IteratorT", bound="Iterator")


# Markers inside seed paths, so that (child 1) and (inner dataset of element 1) never collide.
_EPOCH_MARK = 1 << 62
_INNER_MARK = (1 << 62) + 1
WORKER_MARK = (1 << 62) + 2
RANK_MARK = (1 << 62) + 3
"""Begins a rank's ``BuildContext.salt`` (``graph/distribute.py``)."""


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """Where in the pipeline an iterator is being built; the source of all its seeds.

    Attributes:
        seed: the pipeline seed (``Options.seed``, or one drawn for this iterator).
        seeded: whether the user set ``Options.seed``; only then are the global RNGs seeded
            before each user-function call in this process.
        epoch: how many iterators of this Dataset object were created before this one.
        options: the pipeline's merged options.
        path: the node's structural position (child indices from the root).
        iteration: repetition counters of enclosing ``repeat`` ops.
        memory: what earlier passes of the Dataset learned, by position (see :meth:`learned`).
        trace: the pass's trace log when it is traced (``Options(trace=...)``).
        salt: mixed into every seed drawn here: a rank's mark above the shard that splits a
            pipeline between ranks, so that ranks' shares are not shuffled and augmented alike
            (``graph/distribute.py``); empty elsewhere, where seeds are as they always were.
    """

    seed: int
    seeded: bool
    epoch: int
    options: Options
    path: tuple[int, ...] = ()
    iteration: tuple[int, ...] = ()
    memory: dict[tuple[int, ...], dict[str, Any]] | None = dataclasses.field(default=None, compare=False)
    trace: TraceLog | None = dataclasses.field(default=None, compare=False)
    salt: tuple[int, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a Ray actor (an interleave's readers there): without what earlier passes
        learned and the pass's trace, which belong to this process (inner datasets keep neither)."""
        return {**self.__dict__, "memory": None, "trace": None}

    def learned(self) -> dict[str, Any]:
        """What earlier passes of this Dataset learned about the stage at this position (the
        executor ``auto`` chose, the parallelism the autotuner settled on), for this pass to start
        from and to update. Inside a dataset a user function made, nothing is kept (a fresh dict):
        there is one per input element."""
        if self.memory is None or _INNER_MARK in self.path:
            return {}
        return self.memory.setdefault(self.path, {})

    def child(self, index: int) -> BuildContext:
        return dataclasses.replace(self, path=self.path + (index,))

    def repetition(self, count: int) -> BuildContext:
        return dataclasses.replace(self, iteration=self.iteration + (count,))

    def inner(self, seq: int) -> BuildContext:
        """The context of the dataset that a user function made from input element ``seq``."""
        return dataclasses.replace(self, path=self.path + (_INNER_MARK, seq))

    def build_input(self, node: Node, index: int = 0) -> Iterator:
        ctx = node.input_context(self, index)
        return ctx.traced(node.inputs[index].build(ctx))

    def traced(self, iterator: _IteratorT) -> _IteratorT:
        """``iterator`` (built with this context), recording into the pass's trace if it has one.

        Its stage gets a track named by its position in the graph, so the readers an interleave
        opens, one per input element, share one track."""
        if self.trace is not None and iterator.stats.trace is None:
            position = self.path[: self.path.index(_INNER_MARK) + 1] if _INNER_MARK in self.path else self.path
            order = (len(position), position)
            iterator.stats.trace = self.trace.track((STAGE, position, iterator.name), iterator.name, STAGE, order)
            if self.trace.every_element:
                iterator.stats.clock_all_s = -1.0
            if iterator.stats.calls is not None and iterator.stats.calls.trace is None:
                iterator.stats.calls.trace = self.trace.calls(iterator.name, order)
            knobs: list[LiveKnob] = iterator.knobs() if isinstance(iterator, Tunable) else []
            for knob in knobs:
                knob.trace = self.trace.counter
                self.trace.counter(knob.name, knob.value)
        return iterator

    def stage_seed(self) -> int:
        """A seed for this position that changes every epoch and repetition."""
        return mix_seed(self.seed, *self.path, _EPOCH_MARK, self.epoch, *self.iteration, *self.salt)

    def op_seed(self, explicit: int | None, reshuffle: bool) -> int:
        """The seed of a random op: its own seed if given, else derived from its position.

        Args:
            explicit: the op's ``seed=`` argument.
            reshuffle: whether the op draws anew every epoch and repetition.
        """
        if explicit is None:
            base: tuple[int, ...] = (self.seed, *self.path)
        else:
            base = (explicit, self.options.seed or 0)
        if reshuffle:
            base += (_EPOCH_MARK, self.epoch, *self.iteration)
        return mix_seed(*base, *self.salt)

    def deterministic(self, explicit: bool | None) -> bool:
        return self.options.deterministic if explicit is None else explicit

"""The logical half of an op, :class:`Node` (immutable parameters and inputs, and its traits), and
:class:`BuildContext`, where a node builds its iterator: the source of all its seeds."""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torchpipe.constants import UNKNOWN
from torchpipe.core.tunable import Tunable
from torchpipe.observe.tracing import STAGE, TraceLog
from torchpipe.options import Options
from torchpipe.randomness import mix_seed
from torchpipe.runtime.knob import LiveKnob

if TYPE_CHECKING:  # an iterator is built by a node with a context
    from torchpipe.core.iterator import Iterator


class Node(abc.ABC):
    """A logical op: parameters and input nodes. Immutable and cheap to build."""

    # -- what an op implements ------------------------------------------------------------------
    kind: ClassVar[str]
    """The op's name in ``explain()`` and in checkpoint fingerprints (two classes may share one)."""

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> Iterator:
        """A fresh iterator for one pass over this node's elements."""

    # -- what an op may override (the defaults fit most ops) -----------------------------------
    def params(self) -> dict[str, Any]:
        """The op's parameters, for ``explain()`` and fingerprints (default: none)."""
        return {}

    def cardinality(self) -> int:
        """Number of elements, ``INFINITE`` or ``UNKNOWN`` (default: the first input's)."""
        return self.inputs[0].cardinality() if self.inputs else UNKNOWN

    def is_asynchronous(self) -> bool:
        """Whether the iterator computes ahead of its consumer (on threads or processes)."""
        return False

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        """The context input ``index`` is built with when this node is built with ``ctx``.

        Nodes made by the optimizer override it so that the nodes they stand in for keep
        the contexts (and so the seeds) they have in the graph as written.
        """
        return ctx.child(index)

    def elided_context(self, ctx: BuildContext) -> BuildContext:
        """The context of this node's input when the optimizer removes the node itself (a
        ``repeat`` gives its first repetition's)."""
        return self.input_context(ctx, 0)

    def checkpoint_kinds(self) -> tuple[str, ...]:
        """The op kinds a checkpoint's fingerprint names it by: its own, or its parts' for a
        fused op whose state is theirs (a checkpoint then loads fused or not)."""
        return (self.kind,)

    def label(self) -> str:
        """The op as ``explain()`` shows it: ``kind(name=value, ...)``."""
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in self.params().items())
        return f"{self.kind}({body})"

    # -- traits: facts about the op that passes and checkpoints read (defaults: the safe answer) --
    checkpoints_as_input: ClassVar[bool] = False
    """It leaves no trace in a checkpoint (no iterator, or the input's state as its own);
    checkpoint fingerprints skip it."""

    SPEED_PARAMS: ClassVar[tuple[str, ...]] = (
        "num_parallel_calls",
        "deterministic",
        "executor",
        "pure",
        "batched",
    )
    """Parameters that change how fast it runs, or how the optimizer may run it, but not its
    elements: a checkpoint resumes across them (an inline map's state loads into a parallel one)."""

    reorders_only: ClassVar[bool] = False
    """It only reorders or selects its input's elements, never looking at them (shuffle, take,
    skip, shard, repeat): it runs alike over a source's indices, so source pushdown reads
    ``dataset[i]`` above it, and the rank's shard goes above it."""

    seekable: ClassVar[bool] = False
    """A source that skips an element without reading it (its iterator overrides ``skip``): a
    worker's or rank's shard over it reads only its share, and its state reshards."""

    holds_no_elements: ClassVar[bool] = False
    """No element waits in it between two of its outputs and it counts nothing a rank's state
    would carry: what it consumed is what it passed on, so ``reshard_states`` accepts it above the
    share node. False where that is not known."""

    split_by_hand: str = ""
    """Why this source's elements are one share already (a list from
    ``tp.distributed.share_of_files``), or "": the rank rewrite does not split it again."""

    given_share: str = ""
    """Why this source is the rank's share already (a Ray Train worker's dataset shard), or "":
    the rank rewrite neither splits it again nor evens its length."""

    # -- what the base class does ---------------------------------------------------------------
    def __init__(self, *inputs: Node) -> None:
        self.inputs: tuple[Node, ...] = inputs


def walk(root: Node, inputs_first: bool = False) -> list[Node]:
    """Every node of ``root``'s graph, depth first, inputs in order: the one graph walker.

    Args:
        root: where the walk starts.
        inputs_first: False: each node before its inputs, as often as it is reached (a node
            two paths reach comes twice, as a checkpoint lists its ops); True: each node after
            its inputs, once (so that what a node nearer the root sets comes later and wins).
    """
    if not inputs_first:
        nodes, stack = [], [root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(reversed(node.inputs))
        return nodes
    done: list[Node] = []
    seen: set[int] = set()
    pending: list[tuple[Node, bool]] = [(root, False)]
    while pending:
        node, expanded = pending.pop()
        if expanded:
            done.append(node)
        elif id(node) not in seen:
            seen.add(id(node))
            pending.append((node, True))
            pending.extend((child, False) for child in reversed(node.inputs))
    return done


def node_classes() -> list[type[Node]]:
    """Every op class defined so far (the modules that define them imported), parents first."""
    found: list[type[Node]] = []
    stack = Node.__subclasses__()
    while stack:
        cls = stack.pop()
        if cls not in found:  # a class with two Node parents is reached twice
            found.append(cls)
            stack.extend(cls.__subclasses__())
    return found


class Symbol(str):
    """A parameter value shown bare in ``explain()`` (``AUTOTUNE``, not ``'AUTOTUNE'``)."""

    def __repr__(self) -> str:
        return str(self)


AUTOTUNE_SYMBOL = Symbol("AUTOTUNE")


def _fmt(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return function_name(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def function_name(fn: Any) -> str:
    """A readable name for a user function (``<lambda>``, a class name, ``partial(f)``)."""
    name = getattr(fn, "__name__", None)
    if name is None and hasattr(fn, "func"):
        return Symbol(f"partial({function_name(fn.func)})")
    return Symbol(name if name is not None else type(fn).__name__)


_IteratorT = TypeVar("_IteratorT", bound="Iterator")


# Markers inside seed paths, so that (child 1) and (inner dataset of element 1) never collide.
_EPOCH_MARK = 1 << 62
_INNER_MARK = (1 << 62) + 1
WORKER_MARK = (1 << 62) + 2
RANK_MARK = (1 << 62) + 3
"""Begins a rank's ``BuildContext.salt`` (``distributed/ranks.py``)."""


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
            (``distributed/ranks.py``); empty elsewhere, where seeds are as they always were.
    """

    seed: int
    seeded: bool
    epoch: int
    options: Options
    path: tuple[int, ...] = ()
    iteration: tuple[int, ...] = ()
    memory: dict[tuple[int, ...], dict[str, Any]] | None = dataclasses.field(
        default=None, compare=False
    )
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
            position = (
                self.path[: self.path.index(_INNER_MARK) + 1]
                if _INNER_MARK in self.path
                else self.path
            )
            order = (len(position), position)
            iterator.stats.trace = self.trace.track(
                (STAGE, position, iterator.name), iterator.name, STAGE, order
            )
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

"""The logical half of an op: :class:`Node`, immutable parameters and inputs, and its traits."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

from torchpipe.constants import UNKNOWN

if TYPE_CHECKING:
    from torchpipe.core.context import BuildContext
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

    def label(self) -> str:
        """The op as ``explain()`` shows it: ``kind(name=value, ...)``."""
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in self.params().items())
        return f"{self.kind}({body})"

    # -- traits: facts about the op that passes and checkpoints read (defaults: the safe answer) --
    checkpoints_as_input: ClassVar[bool] = False
    """It leaves no trace in a checkpoint (no iterator, or the input's state as its own);
    checkpoint fingerprints skip it."""

    SPEED_PARAMS: ClassVar[tuple[str, ...]] = ("num_parallel_calls", "deterministic", "executor", "pure", "batched")
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
    rank shard. False where that is not known."""

    split_by_hand: str = ""
    """Why this source's elements are one share already (a list from
    ``tp.distributed.shard_files``), or "": the rank rewrite does not split it again."""

    given_share: str = ""
    """Why this source is the rank's share already (a Ray Train worker's dataset shard), or "":
    the rank rewrite neither splits it again nor evens its length."""

    # -- what the base class does ---------------------------------------------------------------
    def __init__(self, *inputs: Node) -> None:
        self.inputs: tuple[Node, ...] = inputs


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

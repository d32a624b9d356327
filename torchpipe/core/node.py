"""The logical half of an op: :class:`Node`, immutable parameters and inputs."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

from torchpipe.constants import UNKNOWN
from torchpipe.options import Options

if TYPE_CHECKING:
    from torchpipe.core.context import BuildContext
    from torchpipe.core.iterator import Iterator


class Node(abc.ABC):
    """A logical op: parameters and input nodes. Immutable and cheap to build."""

    kind: ClassVar[str]
    checkpoints_as_input: ClassVar[bool] = False
    """True for ops that leave no trace in a checkpoint (no iterator, or the input's state as
    their own); checkpoint fingerprints skip them."""

    SPEED_PARAMS: ClassVar[tuple[str, ...]] = ("num_parallel_calls", "deterministic", "executor", "pure", "batched")
    """Parameters that change how fast an op runs, or how the optimizer may run it, but not its
    elements: a checkpoint resumes across them (an inline map's state loads into a parallel one)."""

    def __init__(self, *inputs: Node) -> None:
        self.inputs: tuple[Node, ...] = inputs

    def params(self) -> dict[str, Any]:
        """The op's parameters, for ``explain()``."""
        return {}

    def fingerprint_params(self) -> dict[str, Any]:
        """The parameters that decide which elements the op yields, for the fingerprints of
        checkpoints and cache files (``ops/fingerprint.py``): :meth:`params` without
        :attr:`SPEED_PARAMS`, each function as the callable itself (``params()`` shows its name).
        """
        params = {key: value for key, value in self.params().items() if key not in self.SPEED_PARAMS}
        for key, value in params.items():
            attr = getattr(self, key, None)
            if isinstance(value, Symbol) and callable(attr) and value == function_name(attr):
                params[key] = attr
        return params

    def cardinality(self) -> int:
        """Number of elements, ``INFINITE`` or ``UNKNOWN`` (default: the first input's)."""
        return self.inputs[0].cardinality() if self.inputs else UNKNOWN

    def own_options(self) -> Options | None:
        """Options this node sets for the pipeline (only ``with_options`` has any)."""
        return None

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> Iterator:
        """A fresh iterator for one pass over this node's elements."""

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        """The context input ``index`` is built with when this node is built with ``ctx``.

        Nodes made by the optimizer override it so that the nodes they stand in for keep
        the contexts (and so the seeds) they have in the graph as written.
        """
        return ctx.child(index)

    def elided_context(self, ctx: BuildContext) -> BuildContext:
        """The context of this node's input when the optimizer removes the node itself."""
        return self.input_context(ctx, 0)

    def is_asynchronous(self) -> bool:
        """Whether the iterator computes ahead of its consumer (on threads or processes)."""
        return False

    def label(self) -> str:
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in self.params().items())
        return f"{self.kind}({body})"


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

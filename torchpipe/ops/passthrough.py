"""Nodes that hand every element on as it is: ``with_options`` and an op the optimizer removed."""

from __future__ import annotations

from typing import Any

from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.options import Options


class WithOptionsNode(Node):
    """Sets pipeline options; runs as its input (no iterator of its own)."""

    kind = "with_options"
    checkpoints_as_input = True
    reorders_only = True  # options hold for the whole pipeline, wherever they are set

    def __init__(self, input: Node, options: Options) -> None:
        super().__init__(input)
        self.options = options

    def params(self) -> dict[str, Any]:
        return {"options": self.options}

    def is_asynchronous(self) -> bool:
        return self.inputs[0].is_asynchronous()

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx  # setting options does not move the seeds of what is below

    def build(self, ctx: BuildContext) -> Iterator:
        return ctx.build_input(self)


class ElidedNode(Node):
    """Stands in for ops the optimizer removed as no-ops (``take(-1)``, ``repeat(1)``, ...).

    It has no iterator: building it builds its input, with the context the input had below
    the removed ops, so the seeds of everything underneath stay as written.

    Args:
        hops: the removed nodes, outermost first.
        input: the node below them.
    """

    kind = "elided"
    checkpoints_as_input = True
    reorders_only = True  # it hands on its input's elements as they are

    def __init__(self, hops: tuple[Node, ...], input: Node) -> None:
        super().__init__(input)
        self.hops = hops

    def label(self) -> str:
        return "elided(" + ", ".join(hop.label() for hop in self.hops) + ")"

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return walk_contexts(self.hops, ctx)

    def is_asynchronous(self) -> bool:
        return self.inputs[0].is_asynchronous()

    def build(self, ctx: BuildContext) -> Iterator:
        return ctx.build_input(self)


def walk_contexts(hops: tuple[Node, ...], ctx: BuildContext) -> BuildContext:
    """The context below ``hops`` (outermost first) when the first is built with ``ctx``."""
    for hop in hops:
        ctx = hop.elided_context(ctx)
    return ctx

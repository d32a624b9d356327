"""inject_prefetch: a ``prefetch(AUTOTUNE)`` at the end when the last op is synchronous.

The consumer (a training step) then overlaps with the last stages instead of waiting for
them. Nothing is added when the last op already computes ahead (prefetch, a parallel map
or interleave, ``to_device``).
"""

from __future__ import annotations

from torchpipe.constants import AUTOTUNE
from torchpipe.core.node import BuildContext, Node
from torchpipe.ops.prefetch import PrefetchNode
from torchpipe.options import Options

NAME = "inject_prefetch"


class InjectedPrefetchNode(PrefetchNode):
    """A prefetch the optimizer added; its input keeps the root's context (and seeds)."""

    def label(self) -> str:
        return super().label() + " [injected]"

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    if root.is_asynchronous():
        return root
    notes.append(f"{NAME}: added prefetch(buffer_size=AUTOTUNE) after {root.label()}")
    return InjectedPrefetchNode(root, AUTOTUNE)

"""shuffle_repeat_fusion: ``shuffle(...).repeat(n)`` runs as one op with the same output."""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up
from torchpipe.ops.repeat import RepeatNode, ShuffleRepeatNode
from torchpipe.ops.shuffle import ShuffleNode
from torchpipe.options import Options

NAME = "shuffle_repeat_fusion"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        if not (
            isinstance(node, RepeatNode)
            and node.count != 0
            and isinstance(node.inputs[0], ShuffleNode)
        ):
            return None
        fused = ShuffleRepeatNode(node.inputs[0], node)
        notes.append(f"{NAME}: {fused.label()} -> shuffle_repeat")
        return fused

    return rewrite_bottom_up(root, rule)

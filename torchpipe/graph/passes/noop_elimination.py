"""noop_elimination: drop ``take(-1)``, ``skip(0)``, ``repeat(1)``, ``prefetch(0)``, ``shard(1, 0)``."""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up
from torchpipe.ops.passthrough import ElidedNode
from torchpipe.ops.prefetch import PrefetchNode
from torchpipe.ops.repeat import RepeatNode
from torchpipe.ops.select import ShardNode, SkipNode, TakeNode
from torchpipe.options import Options

NAME = "noop_elimination"


def is_noop(node: Node) -> bool:
    """Whether ``node`` passes its input through unchanged."""
    return (
        (isinstance(node, TakeNode) and node.count < 0)
        or (isinstance(node, SkipNode) and node.count == 0)
        or (isinstance(node, RepeatNode) and node.count == 1)
        or (isinstance(node, PrefetchNode) and node.buffer_size == 0)
        or (isinstance(node, ShardNode) and node.num_shards == 1 and node.index == 0)
    )


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        if not is_noop(node):
            return None
        notes.append(f"{NAME}: {node.label()} -> removed")
        below = node.inputs[0]
        if isinstance(below, ElidedNode):
            return ElidedNode((node, *below.hops), below.inputs[0])
        return ElidedNode((node,), below)

    return rewrite_bottom_up(root, rule)

"""map_batch_fusion: a map followed by ``batch`` runs one task per batch.

Each task maps a whole batch and collates it where it ran (in a worker process, straight
into shared memory): one dispatch and one transfer per batch. A sequential map's runs on the
consumer's thread, its elements taken from the input at once and the function called over them
in one loop (no call of torchpipe's an element). Elements keep the sequence numbers, and so the
seeds, they have unfused. A fused chain with a filter is not fused with
the batch (the batch boundaries depend on what the filter keeps).
"""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up
from torchpipe.ops.batch import BatchNode
from torchpipe.ops.fused import FusedMapNode
from torchpipe.ops.map import MapBatchNode, MapNode
from torchpipe.options import Options

NAME = "map_batch_fusion"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        below = node.inputs[0] if node.inputs else None
        if not (type(node) is BatchNode and isinstance(below, MapNode)):
            return None
        if isinstance(below, FusedMapNode) and below.has_filter():
            return None
        fused = MapBatchNode(below, node)
        notes.append(f"{NAME}: {node.label()} -> fused into {below.label()}, one task per batch")
        return fused

    return rewrite_bottom_up(root, rule)

"""source_pushdown: a parallel map over ``from_dataset`` fetches ``dataset[i]`` in its workers.

Only indices cross to the workers; ``__getitems__`` is used when the dataset has it (with
map+batch fusion). Ops between the source and the map that only reorder or select
elements (shuffle, take, skip, shard, repeat) run on the indices with the same seeds.
"""

from __future__ import annotations

from torchpipe.graph.rewrite import rewrite_bottom_up, with_attrs
from torchpipe.ops.base import Node
from torchpipe.ops.map import MapNode, index_chain
from torchpipe.ops.sources import FromDatasetNode
from torchpipe.options import Options

NAME = "source_pushdown"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        if not (isinstance(node, MapNode) and node.num_parallel_calls is not None and not node.pushdown):
            return None
        chain, source = index_chain(node.inputs[0])
        if not isinstance(source, FromDatasetNode):
            return None
        via = "".join(f" through {op.kind}" for op in chain)
        notes.append(f"{NAME}: {source.label()}{via} -> fetched inside {node.name}'s workers")
        return with_attrs(node, pushdown=True)

    return rewrite_bottom_up(root, rule)

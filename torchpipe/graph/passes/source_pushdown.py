"""source_pushdown: a parallel map over ``from_dataset`` fetches ``dataset[i]`` in its workers.

The source is replaced by its indices and the dataset handed to the map, which fetches each
element next to its function (with ``__getitems__`` when the dataset has it and the map is fused
with its batch): only indices cross to the workers. Ops between the source and the map that only
reorder or select elements (``Node.reorders_only``: shuffle, take, skip, shard, repeat,
``with_options``) then run on the indices; every node keeps its place in the graph, so its seeds
and its checkpoint are the same. Where the
pipeline is split between ranks the source already yields indices, read by a ``fetch`` above the
rank's shard (``distributed/ranks.py``); a parallel map over that fetch takes its reads over.
"""

from __future__ import annotations

from typing import Any

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up, with_attrs, with_inputs
from torchpipe.distributed.nodes import FetchNode
from torchpipe.ops.map import MapNode
from torchpipe.ops.source_nodes import FromDatasetNode, IndicesNode
from torchpipe.options import Options

NAME = "source_pushdown"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        if not (
            isinstance(node, MapNode)
            and node.num_parallel_calls is not None
            and node.dataset is None
        ):
            return None
        below = node.inputs[0]
        if isinstance(below, FetchNode):
            notes.append(
                f"{NAME}: {below.label()} above the rank's shard -> fetched inside {node.name}'s workers"
            )
            return with_attrs(with_inputs(node, below.inputs), dataset=below.dataset)
        found = over_indices(below)
        if found is None:
            return None
        indices, source, chain = found
        via = "".join(f" through {kind}" for kind in chain)
        notes.append(f"{NAME}: {source.label()}{via} -> fetched inside {node.name}'s workers")
        return with_attrs(with_inputs(node, (indices,)), dataset=source.dataset)

    return rewrite_bottom_up(root, rule)


def over_indices(node: Node) -> tuple[Node, FromDatasetNode, list[str]] | None:
    """``node`` rebuilt over the indices of the ``from_dataset`` below it, the source, and the
    kinds of the index-only ops in between (top first); None where something else is in between."""
    if isinstance(node, FromDatasetNode):
        return IndicesNode(node), node, []
    if not node.reorders_only:  # it runs on indices as it would on the elements
        return None
    below: Any = over_indices(node.inputs[0])
    if below is None:
        return None
    indices, source, chain = below
    return with_inputs(node, (indices,)), source, [node.kind, *chain]

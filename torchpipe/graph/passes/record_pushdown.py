"""record_pushdown: a parallel map over an interleave of record files reads the records in its workers.

``files.interleave(tp.TFRecordDataset, ...).map(fn, num_parallel_calls=...)`` (or ``flat_map``,
or ``from_webdataset``'s shards) over files that can be read by record address
(``FileOpener.indexed``: local, uncompressed TFRecord files and tar shards) becomes an
interleave of the files' record addresses, inline (it only walks their indexes), with the same
cycle and block order, and a map that fetches each record by its address next to ``fn``, as
source_pushdown fetches a map-style dataset's elements. Fused with
its batch (map_batch_fusion, next), one task a batch reads its records in a few contiguous reads,
then parses, decodes and stacks them. Ops between the interleave and the map that only reorder or
select elements (``Node.reorders_only``: a shuffle, take, skip, repeat) run on the addresses.

Every node keeps its place and kind, and an address iterator keeps a reader's state, so seeds and
checkpoints are the same with the pass on or off. The file names must be known when the pipeline
is built (``tp.list_files``, a list given to ``TFRecordDataset`` or ``tp.from_tensor_slices``
or ``tp.from_iterable``): the pass decides by them whether the files are local.
"""

from __future__ import annotations

import os
from typing import Any

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up, with_attrs, with_inputs
from torchpipe.distributed.nodes import ShareNode, SplitFilesNode
from torchpipe.ops.interleave.interleave import FlatMapNode, InterleaveNode
from torchpipe.ops.map import MapNode
from torchpipe.ops.source_nodes import FromIterableNode, IndexedFiles, TensorSlicesNode, file_opener
from torchpipe.options import Options

NAME = "record_pushdown"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        if not (
            isinstance(node, MapNode)
            and node.num_parallel_calls is not None
            and node.dataset is None
        ):
            return None
        found = over_addresses(node.inputs[0])
        if found is None:
            return None
        below, interleave, indexed, chain = found
        via = "".join(f" through {kind}" for kind in chain)
        notes.append(
            f"{NAME}: {interleave.label()}{via} -> record addresses, the records read inside "
            f"{node.name}'s workers"
        )
        return with_attrs(with_inputs(node, (below,)), dataset=indexed.fetch)

    return rewrite_bottom_up(root, rule)


def over_addresses(node: Node) -> tuple[Node, Node, IndexedFiles, list[str]] | None:
    """``node`` rebuilt over the record addresses of the file interleave below it, that
    interleave, how its files are read by address, and the kinds of the ops in between (top
    first); None where there is no such interleave, or something else is in between."""
    opener = file_opener(node.fn) if isinstance(node, (InterleaveNode, FlatMapNode)) else None
    if opener is not None:
        paths = file_names(node.inputs[0])
        indexed = None if paths is None else opener.indexed(paths)
        if indexed is None:
            return None
        addresses = with_attrs(node, fn=indexed.addresses)
        if isinstance(node, InterleaveNode):  # addresses are read inline: no readers ahead
            addresses = with_attrs(addresses, num_parallel_calls=None)
        return addresses, node, indexed, []
    if not node.reorders_only:
        return None
    below: Any = over_addresses(node.inputs[0])
    if below is None:
        return None
    rebuilt, interleave, indexed, chain = below
    return with_inputs(node, (rebuilt,)), interleave, indexed, [node.kind, *chain]


def file_names(node: Node) -> list[str] | None:
    """The file names a dataset of them can yield, where they are known now (a list at its
    source, under ops that only reorder, select or share them out); else None."""
    while node.reorders_only or isinstance(node, (ShareNode, SplitFilesNode)):
        node = node.inputs[0]
    if isinstance(node, TensorSlicesNode):
        names = node.structure
    elif isinstance(node, FromIterableNode) and isinstance(node.source, (list, tuple)):
        names = node.source
    else:
        return None
    if not isinstance(names, (list, tuple)) or not all(
        isinstance(n, (str, os.PathLike)) for n in names
    ):
        return None
    return [os.fspath(n) for n in names]

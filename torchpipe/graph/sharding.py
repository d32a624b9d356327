"""Sharding by torch DataLoader worker: a pipeline iterated in one yields only that worker's share.

``torch.utils.data.DataLoader(ds, num_workers=n)`` iterates a copy of an IterableDataset in each
of its ``n`` workers; without sharding every element would come ``n`` times. So a ``tp.Dataset``
iterated where ``torch.utils.data.get_worker_info()`` names a worker (torch's workers, and the
replicas of ``tp.DataLoader`` over an IterableDataset that iterates a pipeline) shards itself,
as tf.data auto-shards, by a rewrite the plan applies before the static passes:

- **At the source**, when the pipeline has one source and no ``cache(path)``: worker ``i`` of
  ``n`` takes the source's elements ``i, i + n, i + 2n, ...``. A source that can seek
  (``from_dataset``, ``range``, ``from_tensor_slices``, ``list_files``) reads only those; an
  iterable is read whole, keeping every ``n``-th. Everything above the source runs on the share
  (a ``batch`` batches the worker's elements, a ``take(k)`` takes ``k`` of them).
- **At the output** otherwise (several sources, as ``zip`` or ``choose_from_datasets`` have, whose
  elements must stay paired; or a cache file all workers share): every worker runs the whole
  pipeline and keeps every ``n``-th element.

Without ``Options.seed``, each worker's pass takes its seed from the seed the DataLoader drew for
the epoch (``WorkerInfo.seed - WorkerInfo.id``, the same in all its workers), so workers that
run the whole pipeline shuffle alike and ``torch.manual_seed`` makes a run reproducible.
Datasets that a ``flat_map`` or ``interleave`` function makes are not sharded: their outer
element already was.
"""

from __future__ import annotations

import dataclasses

import torch

from torchpipe.graph.rewrite import rewrite_bottom_up
from torchpipe.ops.base import BuildContext, Node
from torchpipe.ops.cache import CacheNode
from torchpipe.ops.fingerprint import ops_of
from torchpipe.ops.sources import FromDatasetNode, RangeNode, TensorSlicesNode
from torchpipe.ops.structure import ShardNode
from torchpipe.randomness import mix_seed

NAME = "worker_shard"


@dataclasses.dataclass(frozen=True)
class WorkerShard:
    """The torch DataLoader worker this process is: ``index`` of ``num_workers``.

    Attributes:
        seed: a seed all the DataLoader's workers share this epoch.
    """

    num_workers: int
    index: int
    seed: int


def current_worker() -> WorkerShard | None:
    """The worker this process is, or None outside a torch worker (or in the only one)."""
    info = torch.utils.data.get_worker_info()
    if info is None or info.num_workers <= 1:
        return None
    return WorkerShard(info.num_workers, info.id, mix_seed(info.seed - info.id))


class WorkerShardNode(ShardNode):
    """A ``shard`` the plan put in for a torch worker. Its input keeps the context the node had
    where the shard went, so every seed and stage position below stays as written."""

    def label(self) -> str:
        return f"{super().label()} [torch worker {self.index} of {self.num_shards}]"

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx


def shard_for_worker(root: Node, worker: WorkerShard) -> tuple[Node, str]:
    """``root`` with the worker's shard put in (see the module docstring), and a line saying where."""
    return split_for_worker(root, worker.num_workers, worker.index)


def split_for_worker(root: Node, n: int, i: int) -> tuple[Node, str]:
    """``root`` with worker ``i`` of ``n``'s shard put in, and a line saying where."""
    sources = sources_of(root)
    if shards_at_source(root, sources):
        source = sources[0]
        sharded = rewrite_bottom_up(root, lambda node: WorkerShardNode(node, n, i) if node is source else None)
        where = source.label()
    else:
        sharded, where = WorkerShardNode(root, n, i), "the output"
    return sharded, f"{NAME}: torch DataLoader worker {i} of {n} keeps one element in {n} of {where}, from element {i} on"


def describe(root: Node) -> str:
    """Where a torch worker's shard goes in this pipeline, for ``explain()``."""
    sources = sources_of(root)
    if shards_at_source(root, sources):
        reads = "reads only its share" if seeks(sources[0]) else "is read whole, each worker keeping its share"
        return f"each keeps one element in num_workers of {sources[0].label()}, which {reads}"
    why = f"{len(sources)} sources" if len(sources) > 1 else "a cache file the workers share"
    return f"each runs the whole pipeline ({why}) with a seed they share and keeps one element in num_workers of the output"


def shards_at_source(root: Node, sources: list[Node]) -> bool:
    """Whether a shard can go at the pipeline's source: it has one, and no cache file all shards share."""
    return len(sources) == 1 and not any(isinstance(node, CacheNode) and node.path for node in ops_of(root))


def seeks(source: Node) -> bool:
    """Whether ``source`` skips an element without reading it."""
    return isinstance(source, (FromDatasetNode, RangeNode, TensorSlicesNode))


def sources_of(root: Node) -> list[Node]:
    """The pipeline's sources, depth first (a source reached along two paths comes twice)."""
    return [node for node in ops_of(root) if not node.inputs]

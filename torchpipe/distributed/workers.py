"""Splitting by torch DataLoader worker: a pipeline iterated in one yields only that worker's share.

``torch.utils.data.DataLoader(ds, num_workers=n)`` iterates a copy of an IterableDataset in each
of its ``n`` workers; without a split every element would come ``n`` times. So a ``tp.Dataset``
iterated where ``torch.utils.data.get_worker_info()`` names a worker (torch's workers, and the
replicas of ``tp.DataLoader`` over an IterableDataset that iterates a pipeline) splits itself,
as tf.data auto-shards, by a rewrite the plan applies before the static passes:

- **At the source**, when the pipeline has one source and no ``cache(path)``: worker ``i`` of
  ``n`` takes the source's elements ``i, i + n, i + 2n, ...``. A source that can seek
  (``from_dataset``, ``range``, ``from_tensor_slices``, ``list_files``) reads only those; an
  iterable is read whole, keeping every ``n``-th. Everything above the source runs on the share
  (a ``batch`` batches the worker's elements, a ``take(k)`` takes ``k`` of them).
- **At the output** otherwise (several sources, as ``zip`` or ``choose_from_datasets`` have, whose
  elements must stay paired; or a cache file all workers share): every worker runs the whole
  pipeline and keeps every ``n``-th element.

Not where the data is split by hand already (``split_between_workers``, with
``DistributeOptions.policy="auto"``): a pipeline with a ``shard(num_workers, id)`` of the worker's
own, or one that code of the user's iterates in the worker after it took its files from
``tp.distributed.share_of_files`` or asked ``torch.utils.data.get_worker_info()`` (torch's documented
ways to split an IterableDataset by hand, in ``__iter__`` or ``worker_init_fn``). The last cannot
be told apart from code that asked for a seed, so that pass warns at its first element, naming the
options that say which: ``policy="off"`` (the user splits), ``"data"`` (torchpipe does).

Without ``Options.seed``, each worker's pass takes its seed from the seed the DataLoader drew for
the epoch (``WorkerInfo.seed - WorkerInfo.id``, the same in all its workers), so workers that
run the whole pipeline shuffle alike and ``torch.manual_seed`` makes a run reproducible.
Datasets that a ``flat_map`` or ``interleave`` function makes are not split: their outer
element already was.
"""

from __future__ import annotations

import dataclasses

from torchpipe.core.node import BuildContext, Node, walk
from torchpipe.core.rewrite import rewrite_bottom_up
from torchpipe.distributed.context import WATCHING_GET_WORKER_INFO, split_by_hand, worker_info
from torchpipe.ops.cache import CacheNode
from torchpipe.ops.select import ShardNode
from torchpipe.randomness import mix_seed

NAME = "worker_split"


@dataclasses.dataclass(frozen=True)
class TorchWorker:
    """The torch DataLoader worker this process is: ``index`` of ``num_workers``.

    Attributes:
        seed: a seed all the DataLoader's workers share this epoch.
        by_hand: what the user's code in this worker did that splits its data by hand:
            ``"split"`` (took its files from ``tp.distributed.share_of_files``), ``"asked"`` (asked
            ``torch.utils.data.get_worker_info()``), or "".
        own: whether the pipeline is the dataset the worker iterates (no code of the user's
            stands between them, so none can have split it).
    """

    num_workers: int
    index: int
    seed: int
    by_hand: str = ""
    own: bool = True

    def label(self) -> str:
        return f"torch DataLoader worker {self.index} of {self.num_workers}"


def current_worker(dataset: object = None) -> TorchWorker | None:
    """The worker this process is, as it iterates ``dataset``, or None outside a torch worker (or
    in the only one)."""
    info = worker_info()
    if info is None or info.num_workers <= 1:
        return None
    own = dataset is not None and info.dataset is dataset
    return TorchWorker(
        info.num_workers, info.id, mix_seed(info.seed - info.id), split_by_hand(info), own
    )


@dataclasses.dataclass(frozen=True)
class WorkerSplit:
    """How a pass in a torch worker is split between the workers.

    Attributes:
        automatic: whether the plan splits it (puts a worker's share node in).
        shards: the pipeline's own ``shard`` ops that split it by worker (the rank rewrite must
            not take them for a split between ranks).
        note: a line for ``explain()`` where the plan does not split it ("" where it does: the
            split's own line says where it goes).
        warning: what to warn of at the first element, where torchpipe cannot tell whether the
            user's code split the data by hand.
    """

    automatic: bool
    shards: tuple[Node, ...] = ()
    note: str = ""
    warning: str | None = None


def split_between_workers(
    root: Node, worker: TorchWorker, policy: str, rank: tuple[int, int] = (0, 1)
) -> WorkerSplit:
    """Whether torch ``worker`` splits ``root`` itself (``DistributeOptions.policy``, ``"auto"``: not
    where the pipeline or the code that iterates it split the data by hand already).

    Args:
        rank: ``(rank, world_size)`` where the pipeline is also split between ranks.
    """
    who = worker.label()
    if policy == "off":
        return WorkerSplit(
            False,
            note=f"{NAME}: not split between torch DataLoader workers "
            f"(DistributeOptions(policy='off')): {who} gets every element",
        )
    if policy != "auto":
        return WorkerSplit(True)
    shards = tuple(shard for shard in user_shards(root) if _splits_workers(shard, worker, rank))
    if shards:
        return WorkerSplit(
            False,
            shards,
            f"{NAME}: the pipeline shards itself by worker ({shards[0].label()} in "
            f"{who}): not split again",
        )
    return _split_unless_by_hand(worker)


def _split_unless_by_hand(worker: TorchWorker) -> WorkerSplit:
    """``"auto"``'s split for a pipeline that does not shard itself: none where the code that
    iterates it in ``worker`` split the data by hand (or may have, unseen: then a warning)."""
    who = worker.label()
    if worker.own:
        # the pipeline is the worker's dataset: no code of the user's split it
        return WorkerSplit(True)
    if worker.by_hand == "split":
        return WorkerSplit(
            False,
            note=f"{NAME}: the code in {who} took its files from tp.distributed.share_of_files: "
            "not split again",
        )
    if worker.by_hand == "asked":
        return WorkerSplit(
            False,
            note=f"{NAME}: the code in {who} asked torch.utils.data.get_worker_info(), so it "
            "splits its data by hand: not split again",
            warning=_asked_warning(worker),
        )
    if WATCHING_GET_WORKER_INFO:
        # no code of the user's learned which worker it is: none split by it
        return WorkerSplit(True)
    return WorkerSplit(True, warning=_unseen_warning(worker))


def user_shards(root: Node) -> list[ShardNode]:
    """The ``shard`` ops the user wrote in ``root`` (a ``shard(1, 0)`` splits nothing)."""
    return [node for node in walk(root) if type(node) is ShardNode and node.num_shards > 1]


def _splits_workers(shard: ShardNode, worker: TorchWorker, rank: tuple[int, int]) -> bool:
    """Whether the user's ``shard`` op is this worker's share: of the workers, or of ranks x workers."""
    (r, world), (w, workers) = rank, (worker.index, worker.num_workers)
    split = (shard.num_shards, shard.index)
    return split in (
        (workers, w),
        (world * workers, r * workers + w),
        (world * workers, w * world + r),
    )


_HOW_TO_SAY = (
    "say which with tp.Options(distribute=tp.DistributeOptions(policy=...)): 'off' where your code splits "
    "it (torchpipe never does), 'data' where it does not (torchpipe always does)"
)


def _asked_warning(worker: TorchWorker) -> str:
    n = worker.num_workers
    return (
        f"torchpipe: a pipeline is iterated in {worker.label()} by code that asked "
        "torch.utils.data.get_worker_info(), so torchpipe takes it that this code splits the data between "
        f"the workers by hand, and does not split it again. If the code does not split it, every element "
        f"comes {n} times, once from each worker; if it does, splitting it again would lose {n - 1} of "
        f"every {n}. Shard it with .shard(info.num_workers, info.id), which torchpipe recognizes, or "
        f"{_HOW_TO_SAY}."
    )


def _unseen_warning(worker: TorchWorker) -> str:
    n = worker.num_workers
    return (
        f"torchpipe: a pipeline is iterated in {worker.label()} by code of yours, and torchpipe cannot tell "
        "whether that code split the data between the workers by hand (this torch's get_worker_info() "
        f"cannot be watched). It splits the pipeline: each worker keeps one element in {n}. If your code "
        f"split it already, {n - 1} of every {n} elements are lost; without a split, every element would "
        f"come {n} times. Shard it with .shard(info.num_workers, info.id), which torchpipe recognizes, or "
        f"{_HOW_TO_SAY}."
    )


class WorkerShareNode(ShardNode):
    """A ``shard`` the plan put in for a torch worker. Its input keeps the context the node had
    where it went, so every seed and stage position below stays as written."""

    def label(self) -> str:
        return f"{super().label()} [torch worker {self.index} of {self.num_shards}]"

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx


def split_for_worker(root: Node, n: int, i: int) -> tuple[Node, str]:
    """``root`` with worker ``i`` of ``n``'s share node put in (see the module docstring), and a
    line saying where."""
    sources = sources_of(root)
    if split_at_source(root, sources):
        source = sources[0]
        split = rewrite_bottom_up(
            root, lambda node: WorkerShareNode(node, n, i) if node is source else None
        )
        where = source.label()
    else:
        split, where = WorkerShareNode(root, n, i), "the output"
    return (
        split,
        f"{NAME}: torch DataLoader worker {i} of {n} keeps one element in {n} of {where}, from element {i} on",
    )


def describe_worker_split(root: Node) -> str:
    """Where a torch worker's split goes in this pipeline, for ``explain()``."""
    sources = sources_of(root)
    if split_at_source(root, sources):
        reads = (
            "reads only its share"
            if sources[0].seekable
            else "is read whole, each worker keeping its share"
        )
        return f"each keeps one element in num_workers of {sources[0].label()}, which {reads}{_BY_HAND}"
    why = f"{len(sources)} sources" if len(sources) > 1 else "a cache file the workers share"
    return (
        f"each runs the whole pipeline ({why}) with a seed they share and keeps one element in num_workers of "
        f"the output{_BY_HAND}"
    )


_BY_HAND = (
    "; not where it is split by hand already (a shard(num_workers, id), or code of yours that iterates it "
    "and asked get_worker_info() or took tp.distributed.share_of_files)"
)


def split_at_source(root: Node, sources: list[Node]) -> bool:
    """Whether a split can go at the pipeline's source: it has one, and no cache file all shares read."""
    return len(sources) == 1 and not any(
        isinstance(node, CacheNode) and node.path for node in walk(root)
    )


def sources_of(root: Node) -> list[Node]:
    """The pipeline's sources, depth first (a source reached along two paths comes twice)."""
    return [node for node in walk(root) if not node.inputs]

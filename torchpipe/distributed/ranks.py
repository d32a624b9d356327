"""Splitting a pipeline between ranks: where the share node goes, equal lengths, global batches.

On rank ``r`` of ``N`` (``torchpipe/distributed/`` says which) the plan puts one share node in
before the static passes, splitting between ranks x torch DataLoader workers where it runs in
one (so it takes the place of ``distributed/workers.py``'s worker split). Where it goes, by
``DistributeOptions.policy``:

- **file** (``"auto"`` where the pipeline starts from a list of files with at least ranks x
  workers of them: ``tp.list_files``, a ``torchpipe.io`` reader's list, names that a flat_map or
  interleave opens with an io reader): above the file list and the ops that only reorder or
  select it (its shuffle), or where ``tp.io.split_files`` marks: each rank reads its own files.
- **data** (``"auto"`` otherwise, where the pipeline has one source): above the source and the
  ops that only reorder or select its elements (shuffle, take, skip, repeat), so every rank runs
  those alike and splits one order, as ``DistributedSampler`` shuffles and then splits. A
  ``from_dataset`` source then yields indices and ``dataset[i]`` is read above the split: a
  rank reads only its share.
- **output** (several sources, a cache file the ranks share, or ``policy="data"`` over files):
  every rank runs the whole pipeline and keeps one element in N.

Below the split every rank draws the same random numbers (the pass seed all ranks share); above
it each rank's seeds carry its rank, so ranks do not shuffle or augment their shares alike. A
pipeline that shards itself (``shard(...)``) is not split again by ``"auto"``; its seeds are
shared, and its torch workers split it as ``distributed/workers.py`` does. Nor is one whose files are
marked to be read whole on every rank (``from_webdataset(split_by_rank=False)``); its torch
workers split it too. Nor is one whose source is the rank's share already (``tp.from_ray`` over a
Ray Train worker's dataset shard): its seeds carry the rank, and Ray evens the shards' lengths.
Ranks' lengths are made equal (``DistributeOptions.uneven``) by the share node where its input's length
is known, else by an ``equalize`` op at the output: to a length known ahead, or with the ranks
agreeing at every element.
"""

from __future__ import annotations

import dataclasses

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.node import RANK_MARK, Node, walk
from torchpipe.core.rewrite import rewrite_bottom_up, with_attrs, with_inputs
from torchpipe.distributed.collectives import PassGroup
from torchpipe.distributed.context import RankInfo
from torchpipe.distributed.nodes import EqualizeNode, FetchNode, Share, ShareNode, SplitFilesNode
from torchpipe.distributed.workers import (
    TorchWorker,
    sources_of,
    split_at_source,
    split_for_worker,
    user_shards,
)
from torchpipe.ops.batch import BatchNode, PaddedBatchNode, RebatchNode
from torchpipe.ops.interleave.interleave import FlatMapNode, InterleaveNode
from torchpipe.ops.shuffle import ShuffleNode
from torchpipe.ops.source_nodes import FileListNode, FileOpener, FromDatasetNode, IndicesNode
from torchpipe.options import DistributeOptions

NAME = "distribute"


@dataclasses.dataclass
class Distribution:
    """A pipeline split for this process: its rank's share, or its torch worker's, or the whole.

    Attributes:
        written: the graph as written with the share node (and equalizer) in, as checkpoints name it:
            with the batch sizes as written, so that a state names no world size.
        root: the graph the static passes take (``written`` with global batch sizes divided,
            without the equalizer: :meth:`equalized` puts it above what the passes made).
        notes: lines for ``explain()``.
        shared_seed: whether something below the split draws random numbers, so that every
            rank's pass needs the same seed.
        salt: mixed into the seeds above the split (empty where nothing of the user's is above).
        uneven: ``DistributeOptions.uneven``.
        target: the length every rank's pass is cut or padded to, where the ranks' lengths are
            known and differ.
        group: the ranks' agreement a pass needs (opened for each pass) where they are not known.
        warning: what a pass warns of at its first element (None: nothing), where torchpipe
            cannot tell whether the user's code split the data between torch workers by hand.
    """

    written: Node
    root: Node
    notes: list[str]
    shared_seed: bool
    salt: tuple[int, ...]
    uneven: str
    target: int | None = None
    group: PassGroup | None = None
    warning: str | None = None

    def equalized(self, optimized: Node) -> Node:
        """``optimized`` (``root`` after the static passes) made as long as the other ranks'.

        The equalizer goes above everything, prefetches included: its agreement then runs in
        the consumer's thread, one collective per element taken, so that ranks that all stop
        taking at one step (a ``break``) leave no collective half done.
        """
        if self.target is None and self.group is None:
            return optimized
        return EqualizeNode(optimized, self.uneven, self.target, self.group)


@dataclasses.dataclass(frozen=True)
class RankSplit:
    """Where the split goes: ``level`` (``data``, ``file``, ``output``; ``manual`` where the
    pipeline shards itself, by the ``shard`` op ``top`` or a list of files split by hand, ``whole``
    where its files are marked to be read whole on every rank,
    ``given`` where its source is the rank's share already: a Ray Train worker's),
    above ``top`` (whose source is ``source``), and why. ``shuffled``: the files below were
    shuffled with the pipeline seed (``tp.io.split_files(shuffled=True)``)."""

    level: str
    top: Node | None = None
    source: Node | None = None
    why: str = ""
    shuffled: bool = False

    def apply(self, root: Node, share: Share, uneven: str) -> Node:
        """``root`` with the share node in."""
        if self.level in ("manual", "whole", "given"):
            # not split between ranks, but a rank's torch workers must still split its share
            return (
                root
                if share.num_workers == 1
                else split_for_worker(root, share.num_workers, share.worker)[0]
            )
        if self.level == "output":
            return ShareNode(root, share, "output", uneven)
        source, top = self.source, self.top
        assert source is not None and top is not None  # set for a "file" or "element" split
        if isinstance(source, FromDatasetNode) and top is not source:
            # indices below the split, dataset[i] read above it: a rank reads only its share
            below = _replace(top, source, IndicesNode(source))
            split: Node = FetchNode(ShareNode(below, share, self.level, uneven), source.dataset)
        else:
            split = ShareNode(top, share, self.level, uneven)
        return _replace(root, top, split)

    def chain(self) -> list[Node]:
        """The nodes from ``top`` down to the source (below the split)."""
        nodes, node = [], self.top
        while node is not None:
            nodes.append(node)
            node = node.inputs[0] if node.inputs else None
        return nodes

    def random_below(self) -> bool:
        """Whether ranks must share the pass seed for their shares to be disjoint."""
        if self.level == "output":
            return True  # every op is below the split; any of them may draw
        # the ranks' shares are disjoint where what reaches them is one order
        if self.level == "manual":
            return self.top is not None and any(
                getattr(node, "seed", 0) is None for node in walk(self.top)
            )
        if self.level in ("whole", "given"):
            return False  # nothing is split between ranks: their draws need not agree
        return self.shuffled or any(
            isinstance(node, ShuffleNode) and node.seed is None for node in self.chain()
        )

    def note(self, share: Share) -> str:
        """A line for ``explain()``: what ``share`` keeps."""
        return f"{NAME}: {self.sentence(share.describe(), str(share.shares))}"

    def sentence(self, who: str, shares: str) -> str:
        if self.level == "manual":
            return f"{self.why}: not split again ({who}); the ranks share its seeds"
        if self.level == "whole":
            return f"{self.why}: not split ({who} gets every element)"
        if self.level == "given":
            return f"{self.why}: not split again ({who} gets its own share)"
        if self.level == "output":
            return (
                f"{who} runs the whole pipeline ({self.why}) with a seed the ranks share and keeps one element "
                f"in {shares} of the output"
            )
        what = "file" if self.level == "file" else "element"
        # set for a "file" or "element" split
        assert self.source is not None and self.top is not None
        over = "" if self.top is self.source else f" over {self.source.label()}"
        reads = (
            " (indices: dataset[i] is read above the split, for its share only)"
            if (isinstance(self.source, FromDatasetNode) and self.top is not self.source)
            else ""
        )
        return f"{who} keeps one {what} in {shares} of {self.top.label()}{over}{reads}"


def split_for_rank(
    root: Node,
    options: DistributeOptions,
    rank: RankInfo,
    worker: TorchWorker | None,
    wait_s: float | None = None,
    by_worker: tuple[Node, ...] = (),
) -> Distribution:
    """``root`` split for ``rank`` (and the torch ``worker`` this process is, where it splits).

    Args:
        wait_s: how long the ranks' agreement waits for the others (``Options.stall_timeout``).
        by_worker: the pipeline's own ``shard`` ops that split it between torch workers (not
            between ranks: ``workers.split_between_workers``).

    Raises:
        ValueError: for ``policy="file"`` where the pipeline does not start from
            ``tp.list_files`` or has fewer files than ranks x workers; for a global batch size
            that does not divide by the world size; for lengths that differ between ranks in a
            torch DataLoader worker, where the ranks cannot agree.
    """
    workers = (worker.num_workers, worker.index) if worker is not None else (1, 0)
    share = Share(rank.world_size, rank.rank, *workers)
    placement = place(root, options.policy, share, by_worker)
    notes = [placement.note(share)]
    written, run = _split(root, placement, share, options, notes)
    target, group = _equal_lengths(root, placement, options, share, run, wait_s)
    if target is not None or group is not None:
        written = EqualizeNode(written, options.uneven, target, group)
        how = (
            "ends where the shortest rank's does"
            if options.uneven == "drop"
            else ("runs as long as the longest rank's, padded")
        )
        notes.append(f"{NAME}: {written.label()}: this rank's pass {how}")
    salt = (RANK_MARK, rank.rank) if placement.level in ("data", "file", "given") else ()
    shared_seed = placement.random_below() and rank.world_size > 1
    return Distribution(written, run, notes, shared_seed, salt, options.uneven, target, group)


def place(root: Node, policy: str, share: Share, by_worker: tuple[Node, ...] = ()) -> RankSplit:
    """Where ``policy`` puts the split in ``root`` (see the module docstring); ``by_worker``: the
    pipeline's own ``shard`` ops that split it between torch workers, not ranks."""
    nodes, sources = walk(root), sources_of(root)
    marks = [node for node in nodes if isinstance(node, SplitFilesNode)]
    if policy == "auto":
        told = _split_as_told(root, nodes, sources, marks, by_worker)
        if told is not None:
            return told
    single = split_at_source(root, sources)
    mark = next((mark for mark in marks if mark.split), None) if single else None
    files = single and (mark is not None or _starts_from_files(root, sources[0]))
    if policy == "file" and not files:
        names = ", ".join(source.label() for source in sources)
        raise ValueError(
            f"DistributeOptions(policy='file'): the pipeline does not start from tp.list_files(...) or "
            f"another list of files (its sources: {names}); split its elements with policy='data' "
            "(or 'auto')"
        )
    if files and policy in ("auto", "file"):
        return _file_split(root, sources[0], mark, policy, share)
    if single and not files:
        return RankSplit("data", _index_top(root, sources[0]), sources[0])
    why = (
        f"{len(sources)} sources"
        if len(sources) > 1
        else (
            "files, split by element with policy='data'"
            if files
            else "a cache file the ranks share"
        )
    )
    return RankSplit("output", why=why)


def _split_as_told(
    root: Node,
    nodes: list[Node],
    sources: list[Node],
    marks: list[SplitFilesNode],
    by_worker: tuple[Node, ...],
) -> RankSplit | None:
    """Where ``"auto"`` leaves the split to the pipeline, as it says: it shards itself, its
    source's list is split by hand or is the rank's share already, or its files are read whole on
    every rank; None where it says nothing."""
    by_rank = [node for node in user_shards(root) if node not in by_worker]
    if by_rank:
        return RankSplit("manual", by_rank[0], why="the pipeline shards itself")
    listed = next((node.split_by_hand for node in sources if node.split_by_hand), "")
    if listed:
        return RankSplit("manual", why=listed)
    given = next((node.given_share for node in nodes if node.given_share), "")
    if given:  # a source that is already this rank's share (tp.from_ray's)
        return RankSplit("given", why=given)
    if any(not mark.split for mark in marks):
        return RankSplit(
            "whole",
            why="its files are read whole on every rank (from_webdataset(split_by_rank=False))",
        )
    return None


def _file_split(
    root: Node, source: Node, mark: SplitFilesNode | None, policy: str, share: Share
) -> RankSplit:
    """The split of a pipeline that starts from a list of files: by file, where there are files
    enough for every rank and worker.

    Raises:
        ValueError: with ``policy="file"``, where there are not.
    """
    # where tp.io.split_files marks, else above the file list and its shuffle
    top = mark.inputs[0] if mark is not None else _index_top(root, source)
    count = top.cardinality()
    if count == INFINITE or count >= share.shares:
        return RankSplit("file", top, source, shuffled=mark is not None and mark.shuffled)
    if policy == "file":
        raise ValueError(f"DistributeOptions(policy='file'): {share.too_few_files(count)}")
    return RankSplit("output", why=f"{count} files, fewer than {share.shares} ranks x workers")


def describe_rank_split(root: Node, options: DistributeOptions) -> str:
    """Where the split would go on several ranks, for ``explain()`` where there is one."""
    if options.policy == "off":
        return "not split (DistributeOptions(policy='off')): every rank gets every element"
    try:
        placement = place(root, options.policy, Share(2, 0))
    except ValueError as e:
        return str(e)
    return f"{placement.sentence('each rank', 'world_size')} (uneven={options.uneven!r})"


def _split(
    root: Node,
    placement: RankSplit,
    share: Share,
    options: DistributeOptions,
    notes: list[str] | None = None,
) -> tuple[Node, Node]:
    """The graph with ``share``'s node in, as written and with global batch sizes divided."""
    written = placement.apply(root, share, options.uneven)
    if not options.global_batch:
        return written, written
    return written, _divide_batches(written, share.world_size, notes if notes is not None else [])


def _divide_batches(root: Node, world_size: int, notes: list[str]) -> Node:
    divided: list[str] = []

    def per_rank(node: Node, size: int) -> int:
        if size % world_size:
            raise ValueError(
                f"{node.label()}: with DistributeOptions(global_batch=True) on {world_size} ranks the "
                f"global batch size {size} must divide by {world_size}"
            )
        divided.append(f"{node.label()} -> {size // world_size} a rank")
        return size // world_size

    def rule(node: Node) -> Node | None:
        if isinstance(node, (BatchNode, PaddedBatchNode)):
            return with_attrs(node, batch_size=per_rank(node, node.batch_size))
        if isinstance(node, RebatchNode):
            return with_attrs(node, batch_sizes=[per_rank(node, size) for size in node.batch_sizes])
        return None

    out = rewrite_bottom_up(root, rule)
    if not divided:
        raise ValueError(
            "DistributeOptions(global_batch=True): the pipeline has no batch, padded_batch or rebatch "
            "whose size is global"
        )
    notes.append(f"{NAME}: global batch sizes: " + "; ".join(divided))
    return out


def _equal_lengths(
    root: Node,
    placement: RankSplit,
    options: DistributeOptions,
    share: Share,
    run: Node,
    wait_s: float | None,
) -> tuple[int | None, PassGroup | None]:
    """The length every rank's pass gets where each is known, or the agreement the ranks need."""
    if options.uneven == "allow" or share.world_size == 1 or run.cardinality() == INFINITE:
        return None, None
    if placement.level == "whole":
        return None, None  # every rank reads the same files whole
    if placement.level == "given":
        return (
            None,
            None,
        )  # the source evens its shards (Ray's streaming_split(equal=True), as Ray Train does)
    lengths = (
        {UNKNOWN}
        if placement.level == "manual"
        else {
            _split(root, placement, Share(share.world_size, index), options)[1].cardinality()
            for index in (0, share.world_size - 1)  # the longest and the shortest share
        }
    )
    if len(lengths) == 1 and UNKNOWN not in lengths:
        return None, None
    if share.num_workers > 1:
        raise ValueError(
            f"{NAME}: this pipeline's length differs between ranks ({_lengths_text(lengths)}), and in torch "
            "DataLoader workers the ranks cannot agree where it ends: iterate it with tp.DataLoader(pipeline), "
            "which runs it in the rank's own process, or leave the lengths alone with "
            "DistributeOptions(uneven='allow')"
        )
    if UNKNOWN in lengths:
        return None, PassGroup(wait_s)
    return (min(lengths) if options.uneven == "drop" else max(lengths)), None


def _lengths_text(lengths: set[int]) -> str:
    return "not known ahead" if UNKNOWN in lengths else " vs ".join(map(str, sorted(lengths)))


def _starts_from_files(root: Node, source: Node) -> bool:
    """Whether ``source`` is a list of files: ``tp.list_files``' or an io reader's, or names that the
    first op above its index ops opens with an io reader (``ops.sources.FileOpener``)."""
    if isinstance(source, FileListNode):
        return True
    top = _index_top(root, source)
    path = _path(root, top)
    above = path[-2] if len(path) > 1 else None
    return isinstance(above, (FlatMapNode, InterleaveNode)) and isinstance(above.fn, FileOpener)


def _index_top(root: Node, source: Node) -> Node:
    """The highest node above ``source`` that only reorders or selects its elements."""
    path = _path(root, source)
    top = source
    for node in reversed(path[:-1]):
        if not node.reorders_only:
            break
        top = node
    return top


def _path(root: Node, target: Node) -> list[Node]:
    """The nodes from ``root`` down to ``target`` (a one-source pipeline is a chain)."""
    path, node = [root], root
    while node is not target:
        node = node.inputs[0]
        path.append(node)
    return path


def _replace(node: Node, target: Node, replacement: Node) -> Node:
    """``node``'s graph with ``target`` replaced, copying the nodes above it."""
    if node is target:
        return replacement
    return with_inputs(node, tuple(_replace(child, target, replacement) for child in node.inputs))

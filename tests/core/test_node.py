"""Nodes: op traits declared on the node class (the table of every op's traits, and what they
decide), and ``walk``, the one graph walker, in its two orders.

The table lists every op class, so that adding an op forces a decision on each trait. The behaviour
tests go through the public API: source pushdown (``dataset[i]`` read in a parallel map's workers,
and ``explain()``), the rank split (each rank reads only its share) and ``reshard_states``.
"""

from __future__ import annotations

import collections
import importlib
import pkgutil
import threading

import pytest
import torch

import torchpipe as tp
from torchpipe.core.node import Node, node_classes, walk
from torchpipe.distributed.reshard import allowed_above, allowed_below

TRAITS = ("reorders_only", "seekable", "holds_no_elements", "checkpoints_as_input")
R, S, H, C = "reorders_only", "seekable", "holds_no_elements", "checkpoints_as_input"

# Each op class and the traits it has (the others are False). An op the optimizer or a rewrite
# makes (elided, fused_map, map_batch, shuffle_repeat, prefetch injected, the shard nodes) is here too.
TABLE: dict[str, set[str]] = {
    "AddressNode": set(),  # a file's record addresses, read as its reader reads (record_pushdown)
    "BatchNode": {H},
    "BucketBySequenceLengthNode": set(),
    "CacheNode": set(),
    "ChooseFromDatasetsNode": set(),
    "ConcatenateNode": set(),
    "DeviceNode": {H},
    "ElidedNode": {R, C},
    "EqualizeNode": set(),  # it counts; reshard_states resets its counts itself
    "FetchNode": {C},
    "FileListNode": {S},
    "FilterNode": {H},
    "FlatMapNode": set(),
    "FromDatasetNode": {S},
    "FromIterableNode": set(),
    "FusedMapNode": {H},  # a chain of maps and filters
    "IgnoreErrorsNode": {H},
    "IndicesNode": {S},
    "InjectedPrefetchNode": {C},
    "InterleaveNode": set(),
    "MapBatchNode": set(),
    "MapNode": {H},
    "PaddedBatchNode": {H},
    "PrefetchNode": {C},
    "RangeNode": {S},
    "RayDataNode": set(),
    "RebatchNode": set(),
    "RepeatNode": {R},
    "ShareNode": set(),
    "EnumerateNode": set(),
    "ScanNode": set(),
    "SampleFromDatasetsNode": set(),
    "ShardNode": {R},
    "ShuffleNode": {R},
    "ShuffleRepeatNode": {R},
    "SkipNode": {R},
    "SnapshotNode": set(),
    "SplitFilesNode": {C},
    "TakeNode": {R},
    "TakeWhileNode": set(),
    "TarShardNode": set(),
    "TensorSlicesNode": {S},
    "TFRecordFileNode": set(),
    "UnbatchNode": set(),
    "WindowNode": set(),  # holds the elements of the windows in progress
    "WithOptionsNode": {R, C},
    "WorkerShareNode": {R},  # a ShardNode: a torch worker's share
    "ZipNode": set(),
}


def _op_classes() -> list[type[Node]]:
    for module in pkgutil.walk_packages(tp.__path__, "torchpipe."):
        importlib.import_module(module.name)
    return [
        cls
        for cls in node_classes()
        if cls.__module__.startswith("torchpipe.") and hasattr(cls, "kind")
    ]


def test_every_op_class_declares_its_traits():
    classes = _op_classes()
    assert {cls.__name__ for cls in classes} == set(TABLE), (
        "a new op: add it to TABLE with its traits"
    )
    for cls in classes:
        got = {trait for trait in TRAITS if getattr(cls, trait)}
        assert got == TABLE[cls.__name__], cls.__name__


def test_classes_that_share_a_kind_agree_on_what_reshard_reads():
    by_kind = collections.defaultdict(list)
    for cls in _op_classes():
        if not cls.checkpoints_as_input:
            by_kind[cls.kind].append(cls)
    for kind, classes in by_kind.items():
        for trait in ("reorders_only", "seekable", "holds_no_elements"):
            assert len({getattr(cls, trait) for cls in classes}) == 1, (kind, trait, classes)


def test_reshard_allows_the_kinds_it_allowed_before_plus_what_the_optimizer_makes_of_them():
    _op_classes()
    old_above = {"equalize", "map", "filter", "batch", "padded_batch", "ignore_errors", "to_device"}
    old_below = {
        "shuffle",
        "take",
        "skip",
        "repeat",
        "shard",
        "from_dataset",
        "range",
        "from_tensor_slices",
    }
    assert allowed_above() == old_above | {"fused_map"}
    assert allowed_below() == old_below | {"shuffle_repeat"}


# -- source pushdown through the ops that only reorder or select --------------------------------
class Numbers(torch.utils.data.Dataset):
    """``i`` at index ``i``, remembering the indices read and whether the main thread read them."""

    def __init__(self, n):
        self.n = n
        self.reads = []
        self.on_main = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        self.on_main.append(threading.current_thread() is threading.main_thread())
        return i


def _pushdown_line(ds):
    """What the source pushdown pass did to ``ds``: a note a push."""
    return ds.explain(as_dict=True)["rewrites"].get("source_pushdown", [])


@pytest.mark.parametrize(
    ("between", "through"),
    [
        (
            lambda ds: ds.with_options(tp.Options(seed=3)),
            "through with_options",
        ),  # broken before: see below
        (lambda ds: ds.take(-1), "through elided"),
        (lambda ds: ds.shuffle(4, seed=0).repeat(2), "through shuffle_repeat"),
    ],
)
def test_a_parallel_map_reads_the_dataset_in_its_workers_through_ops_that_only_reorder(
    between, through
):
    # ShuffleRepeatNode and ElidedNode are made by passes that run before source pushdown; with_options
    # stays in the graph. The pushdown pass's own list of index ops lacked WithOptionsNode, so a
    # with_options between the source and a parallel map kept every dataset[i] on the main thread.
    source = Numbers(12)
    ds = between(tp.from_dataset(source)).map(
        lambda x: x * 10, num_parallel_calls=2, executor="thread"
    )
    plain = between(tp.from_dataset(Numbers(12))).map(lambda x: x * 10)
    assert any(through in line for line in _pushdown_line(ds)), ds.explain()
    assert list(ds) == list(plain)
    assert source.on_main and not any(source.on_main)  # every dataset[i] ran in the map's threads


# -- the rank split goes above the same ops ------------------------------------------------------
def _on_rank(ds, rank, world_size, **options):
    distribute = tp.DistributeOptions(rank=rank, world_size=world_size, **options)
    return ds.with_options(tp.Options(seed=7, distribute=distribute))


@pytest.mark.parametrize(
    "between",
    [
        lambda ds: ds.with_options(tp.Options(deterministic=True)),
        lambda ds: ds.take(-1),  # elided by the optimizer, after the split
        lambda ds: ds.shuffle(30).repeat(2),  # fused into shuffle_repeat, after the split
    ],
)
def test_each_rank_reads_only_its_share_through_ops_that_only_reorder(between):
    shares, sources = [], []
    for rank in range(2):
        sources.append(Numbers(30))
        shares.append(
            list(_on_rank(between(tp.from_dataset(sources[-1])).map(lambda x: x + 1), rank, 2))
        )
    whole = list(
        between(tp.from_dataset(Numbers(30))).map(lambda x: x + 1).with_options(tp.Options(seed=7))
    )
    assert collections.Counter(shares[0] + shares[1]) == collections.Counter(whole)
    for share, source in zip(shares, sources):
        # dataset[i] read for its share only
        assert sorted(source.reads) == sorted(x - 1 for x in share)


# -- the sources' traits ---------------------------------------------------------------------------
def test_explain_says_whether_a_torch_workers_shard_reads_only_its_share():
    seeks = "reads only its share"
    assert seeks in tp.range(10).explain()
    assert seeks in tp.from_tensor_slices(torch.arange(10)).explain()
    assert seeks in tp.from_dataset(Numbers(10)).explain()
    assert seeks not in tp.from_iterable(lambda: iter(range(10))).explain()


def test_reshard_refuses_a_source_that_cannot_seek_below_the_rank_shard():
    make = lambda: tp.from_iterable(lambda: iter(range(20)))  # noqa: E731
    its = [iter(_on_rank(make(), rank, 2, uneven="allow")) for rank in range(2)]
    states = []
    for it in its:
        next(it)
        states.append(it.state_dict())
    with pytest.raises(tp.CheckpointError, match="from_iterable.*below the share node"):
        tp.distributed.reshard_states(states, 3)


# -- walk ----------------------------------------------------------------------------------------


class Op(Node):
    """A node that is only its name and its inputs."""

    def __init__(self, kind, *inputs):
        super().__init__(*inputs)
        self.kind = kind

    def build(self, ctx):
        raise AssertionError("a walk builds nothing")


def _kinds(nodes):
    return [node.kind for node in nodes]


def test_walk_lists_each_node_before_its_inputs_as_often_as_it_is_reached():
    shared = Op("source")
    nodes = walk(Op("zip", Op("map", shared), shared))
    assert _kinds(nodes) == ["zip", "map", "source", "source"]
    assert nodes[2] is nodes[3] is shared


def test_walk_inputs_first_lists_each_node_after_its_inputs_once():
    shared = Op("source")
    root = Op("zip", Op("map", shared), Op("take", shared))
    assert _kinds(walk(root, inputs_first=True)) == ["source", "map", "take", "zip"]


def test_walk_goes_deeper_than_the_recursion_limit():
    node = Op("source")
    for _ in range(3000):
        node = Op("map", node)
    assert len(walk(node)) == len(walk(node, inputs_first=True)) == 3001

"""distributed.rewrite.distribute: the one place that splits a plan for this process's rank and worker."""

from torchpipe.core.node import walk
from torchpipe.distributed.context import RankInfo
from torchpipe.distributed.nodes import ShareNode
from torchpipe.distributed.rewrite import distribute
from torchpipe.distributed.workers import TorchWorker, WorkerShareNode
from torchpipe.ops.source_nodes import RangeNode
from torchpipe.options import DistributeOptions, Options


def _types(root):
    return [type(node).__name__ for node in walk(root)]


def test_a_process_with_neither_rank_nor_worker_runs_the_pipeline_as_written():
    root = RangeNode(0, 8, 1)
    distribution = distribute(root, Options(), None, None)
    assert distribution.written is distribution.root is root
    assert distribution.notes == [] and distribution.equalized(root) is root


def test_a_torch_worker_keeps_its_share_at_the_source():
    distribution = distribute(RangeNode(0, 8, 1), Options(), TorchWorker(2, 1, seed=0), None)
    assert _types(distribution.root) == ["WorkerShareNode", "RangeNode"]
    assert isinstance(distribution.written, WorkerShareNode)
    assert distribution.notes == [
        "worker_split: torch DataLoader worker 1 of 2 keeps one element in 2 of "
        "range(start=0, stop=8, step=1), from element 1 on"
    ]


def test_a_rank_in_a_torch_worker_is_split_once_for_both():
    options = Options(distribute=DistributeOptions(rank=1, world_size=2))
    distribution = distribute(
        RangeNode(0, 8, 1), options, TorchWorker(2, 0, seed=0), RankInfo(1, 2, False)
    )
    assert _types(distribution.root) == [
        "ShareNode",
        "RangeNode",
    ]  # no worker share on top of the rank's
    (share,) = [node for node in walk(distribution.root) if isinstance(node, ShareNode)]
    assert share.share.describe() == "rank 1 of 2 x torch worker 0 of 2"
    assert distribution.salt and not distribution.shared_seed

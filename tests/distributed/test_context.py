"""Who this process is: its rank (from DistributeOptions or torch.distributed) and its share."""

import torchpipe as tp
from torchpipe.distributed.context import current_rank_info, current_share
from torchpipe.distributed.nodes import Share
from torchpipe.testing import as_torch_worker


def test_rank_discovery():
    # torch.distributed is not initialized here
    assert current_rank_info() is None and current_share() is None
    assert current_rank_info(tp.DistributeOptions(rank=1, world_size=3)).rank == 1
    assert (
        current_rank_info(tp.DistributeOptions(rank=0, world_size=1)).world_size == 1
    )  # a split of one
    assert current_rank_info(tp.DistributeOptions(policy="off", rank=1, world_size=3)) is None
    with as_torch_worker(1, 2):
        assert current_share(tp.DistributeOptions(rank=1, world_size=3)) == Share(3, 1, 2, 1)

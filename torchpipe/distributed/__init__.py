"""Distributed input: everything about ranks and torch DataLoader workers, in one package.

A pipeline iterated where ``torch.distributed`` is initialized with a world size above 1 (or
``tp.DistributeOptions(rank=..., world_size=...)`` says so) yields this rank's share; one iterated
in a torch DataLoader worker yields that worker's share, unless it was split by hand. The words,
one for each idea:

- a **share** is the part of the data one rank, or one worker of a rank, reads (:class:`Share`,
  the share node that keeps it, :func:`current_share`, :func:`share_of_files`);
- a **split** is what the runtime does to make the shares: the rewrites by rank, by worker and by
  file (``tp.io.split_files`` marks where files are split);
- a **rank** is one of the processes ``torch.distributed`` numbers (:class:`RankInfo`,
  :func:`current_rank_info`);
- a **shard** is only the user's op, ``ds.shard(n, i)``; files on disk are files; resharding
  (:func:`reshard_states`) converts N ranks' checkpoints for M.

docs/distributed.md tells the whole story. The modules:

- ``context``: who this process is, the one place that reads torch's worker info and the
  process group (and notes when the user's code asked for the worker info);
- ``collectives``: rank 0's seed for a pass and the ranks' agreement on its end, each bounded;
- ``nodes``: the ops the rewrites put in (a share node, equal lengths, fetch above it);
- ``rewrite``: the distribution rewrite, :func:`~torchpipe.distributed.rewrite.distribute`, the
  one function the plan calls before the static passes; it splits by ``ranks`` and by
  ``workers``, the modules that place the share nodes;
- ``files``: the same split for a plain list of files (:func:`share_of_files`);
- ``reshard``: one epoch's checkpoints of N ranks converted for M ranks.
"""

from torchpipe.deprecation import renamed_names
from torchpipe.distributed.context import RankInfo, current_rank_info, current_share
from torchpipe.distributed.files import share_of_files
from torchpipe.distributed.nodes import Share
from torchpipe.distributed.reshard import reshard_states

__all__ = [
    "RankInfo",
    "Share",
    "current_rank_info",
    "current_share",
    "reshard_states",
    "share_of_files",
]

__getattr__ = renamed_names(
    __name__,
    {
        "Replica": "RankInfo",
        "current_replica": "current_rank_info",
        "current_shard": "current_share",
        "shard_files": "share_of_files",
    },
    globals(),
)

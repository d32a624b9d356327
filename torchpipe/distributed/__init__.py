"""Distributed input: everything about ranks and torch DataLoader workers, in one package.

A pipeline iterated where ``torch.distributed`` is initialized with a world size above 1 (or
``tp.DistributeOptions(rank=..., world_size=...)`` says so) yields this rank's share; one iterated
in a torch DataLoader worker yields that worker's share, unless it was split by hand. The words:
a **share** is the part of the data one rank, or one worker of a rank, reads; ``shard(n, i)`` is
the user's op; files on disk are files. docs/distributed.md tells the whole story.

- ``context``: who this process is, the one place that reads torch's worker info and the
  process group (and notes when the user's code asked for the worker info);
- ``collectives``: rank 0's seed for a pass and the ranks' agreement on its end, each bounded;
- ``nodes``: the ops the rewrites put in (a share of a stream, equal lengths, fetch above it);
- ``ranks`` and ``workers``: the rewrites that split a plan between ranks and between workers;
- ``files``: the same split for a plain list of files (:func:`shard_files`);
- ``reshard``: one epoch's checkpoints of N ranks converted for M ranks.
"""

from torchpipe.distributed.context import Replica, current_replica, current_shard
from torchpipe.distributed.files import shard_files
from torchpipe.distributed.reshard import reshard_states

__all__ = ["Replica", "current_replica", "current_shard", "reshard_states", "shard_files"]

"""The files one share reads: :func:`shard_files`, for readers of the user's own."""

from __future__ import annotations

from collections.abc import Sequence

from torchpipe.distributed.context import current_shard, note_split_by_hand, worker_info
from torchpipe.distributed.nodes import Share
from torchpipe.ops.source_nodes import SplitFileList


def shard_files(files: Sequence[str], shard: Share | None = None) -> list[str]:
    """The files that ``shard`` reads: the split ``policy="file"`` makes, for any reader.

    Ranks take the files in turn (file ``i`` to rank ``i % world_size``), and a rank's files go
    to its torch DataLoader workers in turn, so every file is read by exactly one shard and a
    rank reads the same files with or without workers. This is the list form of the split a
    pipeline's rank shard makes (``Share.owns``); in a pipeline, mark the names with
    ``tp.io.split_files`` instead, which splits them when each pass starts. A pipeline that
    starts from the list returned (``tp.from_tensor_slices``, a ``torchpipe.io`` reader) is split
    by hand: it is not split again, between ranks or between torch DataLoader workers.

    Args:
        files: every file, in the order all shards agree on.
        shard: which share; default :func:`current_shard` (all the files where there is none).

    Raises:
        ValueError: where there are fewer files than ranks x workers (one would read nothing).
    """
    if shard is None:
        shard = current_shard()
        if shard is not None and shard.num_workers > 1:
            note_split_by_hand(worker_info(), "split")  # this worker's code split its data: not again
    if shard is None:
        return list(files)
    if len(files) < shard.shards:
        raise ValueError(shard.too_few_files(len(files)))
    return SplitFileList((name for i, name in enumerate(files) if shard.owns(i)), shard)

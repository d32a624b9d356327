"""The files one share reads: :func:`share_of_files`, for readers of the user's own."""

from __future__ import annotations

from collections.abc import Sequence

from torchpipe.distributed.context import current_share, note_split_by_hand, worker_info
from torchpipe.distributed.nodes import Share
from torchpipe.ops.source_nodes import SplitFileList


def share_of_files(files: Sequence[str], share: Share | None = None) -> list[str]:
    """The files that ``share`` reads: the split ``policy="file"`` makes, for any reader.

    Ranks take the files in turn (file ``i`` to rank ``i % world_size``), and a rank's files go
    to its torch DataLoader workers in turn, so every file is read by exactly one share and a
    rank reads the same files with or without workers. This is the list form of the split a
    pipeline's rank split makes (``Share.owns``); in a pipeline, mark the names with
    ``tp.io.split_files`` instead, which splits them when each pass starts. A pipeline that
    starts from the list returned (``tp.from_tensor_slices``, a ``torchpipe.io`` reader) is split
    by hand: it is not split again, between ranks or between torch DataLoader workers.

    Args:
        files: every file, in the order all shares agree on.
        share: which share; default :func:`~torchpipe.distributed.current_share` (all the files
            where there is none).

    Raises:
        ValueError: where there are fewer files than ranks x workers (one would read nothing).
    """
    if share is None:
        share = current_share()
        if share is not None and share.num_workers > 1:
            # this worker's code split its data: not again
            note_split_by_hand(worker_info(), "split")
    if share is None:
        return list(files)
    if len(files) < share.shares:
        raise ValueError(share.too_few_files(len(files)))
    return SplitFileList((name for i, name in enumerate(files) if share.owns(i)), share)

"""Splitting a list of files across distributed ranks: ``tp.io.split_files``.

It marks where the split goes; the split itself is the one every pipeline gets on several ranks
(``graph/distribute.py``, docs/distributed.md): each rank reads every ``world_size``-th file,
its torch DataLoader workers their share of those, as ``DistributeOptions`` says (``"off"``, an
explicit rank and world size), decided when the pass starts. Whatever comes before the split (a
shard shuffle) is the same on every rank: the ranks share the pass seed.
"""

from __future__ import annotations

from torchpipe.dataset import Dataset, _check_bool
from torchpipe.ops.distribute import SplitFilesNode


def split_files(files: Dataset, *, shuffled: bool = False) -> Dataset:
    """``files`` (a dataset of file names) split across ranks: each rank reads every
    ``world_size``-th file (nothing changes outside ``torch.distributed``, without
    ``DistributeOptions(rank=..., world_size=...)``, or with ``policy="off"``).

    A pipeline that starts from a list of files (``tp.list_files``, ``tp.TFRecordDataset``,
    ``tp.from_webdataset``) is split by file on several ranks without it; ``split_files`` puts the
    split at this point (above ops of your own on the names, say). With ``policy="data"`` the
    elements are split instead and ``split_files`` passes every file. For a plain list of names,
    ``tp.distributed.shard_files`` is the same split.

    Args:
        files: the file names, the same list on every rank.
        shuffled: say that ``files`` was shuffled with the pipeline seed, so the ranks share one
            (rank 0's is broadcast where the pipeline has none; a pass that cannot share one, in
            a torch DataLoader worker, fails instead of giving ranks overlapping files).

    Raises:
        TypeError: for ``files`` that is not a ``tp.Dataset``, or a ``shuffled`` that is not a bool.
    """
    _check_bool("split_files", "shuffled", shuffled)
    if not isinstance(files, Dataset):
        raise TypeError(f"split_files: expected a tp.Dataset of file names, got {type(files).__name__}")
    return Dataset(SplitFilesNode(files._node, shuffled))

"""Splitting a list of files across distributed ranks.

Where a pipeline starts from files, each rank (``torch.distributed``) reads every
``world_size``-th file, decided when the pass starts. Whatever comes before the split (a shard
shuffle) must be the same on every rank, so a shuffle there needs a seed shared by all ranks.
Workers of a torch ``DataLoader`` need nothing here: the plan shards every pipeline at its source
for them (``graph/sharding.py``), so each worker reads its share of a rank's files.
"""

from __future__ import annotations

from typing import Any

import torch

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.dataset import Dataset, _check_bool
from torchpipe.errors import CheckpointError
from torchpipe.ops.base import BuildContext, Iterator, Node
from torchpipe.ops.structure import ShardIterator


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks (``(0, 1)`` outside ``torch.distributed``)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SplitFilesNode(Node):
    """The input's files that belong to this rank.

    Args:
        input: a node of file names.
        shuffled: the input is shuffled by the pipeline seed (which must then be shared).
    """

    kind = "split_files"

    def __init__(self, input: Node, shuffled: bool) -> None:
        super().__init__(input)
        self.shuffled = shuffled

    def part(self) -> tuple[int, int]:
        """``(index, count)`` of this process's share: its rank and the number of ranks."""
        return rank_and_world()

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        index, count = self.part()
        return n if n in (INFINITE, UNKNOWN) else n // count + (1 if index < n % count else 0)

    def build(self, ctx: BuildContext) -> Iterator:
        index, count = self.part()
        files = self.inputs[0].cardinality()
        if count > 1 and files not in (INFINITE, UNKNOWN) and files < count:
            raise ValueError(f"{self.kind}: {files} files cannot be split across {count} ranks: "
                             "some would read nothing")  # fmt: skip
        if count > 1 and self.shuffled and not ctx.seeded:
            raise ValueError(f"{self.kind}: the files are shuffled before they are split across ranks, so every "
                             "rank needs the same seed: set tp.Options(seed=...) or the shuffle's seed")  # fmt: skip
        return SplitFilesIterator(self.kind, ctx.build_input(self), count, index)


class SplitFilesIterator(ShardIterator):
    """Every ``count``-th input element from ``index``; a checkpoint names its share."""

    PART = "part"

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), self.PART: [self._index, self._num_shards]}

    def set_state(self, state: dict[str, Any]) -> None:
        part = state.get(self.PART)
        if part != [self._index, self._num_shards]:
            raise CheckpointError(f"{self.name}: the checkpoint is of share {part} (index, count) of the files, "
                                  f"but this process reads share {[self._index, self._num_shards]}")  # fmt: skip
        super().set_state(state)


def split_files(files: Dataset, *, shuffled: bool = False) -> Dataset:
    """``files`` (a dataset of file names) split across ``torch.distributed`` ranks: each rank
    reads every ``world_size``-th file (nothing changes outside ``torch.distributed``).

    Args:
        files: the file names, the same list on every rank.
        shuffled: say that ``files`` was shuffled with the pipeline seed, so a pass across
            ranks without a seed fails instead of giving ranks overlapping files.
    """
    _check_bool("split_files", "shuffled", shuffled)
    if not isinstance(files, Dataset):
        raise TypeError(f"split_files: expected a tp.Dataset of file names, got {type(files).__name__}")
    return Dataset(SplitFilesNode(files._node, shuffled))

"""Splitting a list of files across distributed ranks and DataLoader workers.

Where a pipeline starts from files, each rank (``torch.distributed``) and each worker of a
torch ``DataLoader`` iterating the pipeline reads every ``ranks * workers``-th file, decided
when the pass starts. Whatever comes before the split (a shard shuffle) must be the same on
every rank, so a shuffle there needs a pipeline seed shared by all ranks.
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


def worker_and_count() -> tuple[int, int]:
    """This DataLoader worker's id and the number of workers (``(0, 1)`` outside one)."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class SplitFilesNode(Node):
    """The input's files that belong to this rank and worker.

    Args:
        input: a node of file names.
        by_rank: split across ``torch.distributed`` ranks.
        by_worker: split across the workers of a torch DataLoader.
        shuffled: the input is shuffled by the pipeline seed (which must then be shared).
    """

    kind = "split_files"

    def __init__(self, input: Node, by_rank: bool, by_worker: bool, shuffled: bool) -> None:
        super().__init__(input)
        self.by_rank, self.by_worker, self.shuffled = by_rank, by_worker, shuffled

    def params(self) -> dict[str, Any]:
        return {"by_rank": self.by_rank, "by_worker": self.by_worker}

    def part(self) -> tuple[int, int]:
        """``(index, count)`` of this process's share, as of now."""
        rank, ranks = rank_and_world() if self.by_rank else (0, 1)
        worker, workers = worker_and_count() if self.by_worker else (0, 1)
        return rank * workers + worker, ranks * workers

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        index, count = self.part()
        return n if n in (INFINITE, UNKNOWN) else n // count + (1 if index < n % count else 0)

    def build(self, ctx: BuildContext) -> Iterator:
        index, count = self.part()
        files = self.inputs[0].cardinality()
        if count > 1 and files not in (INFINITE, UNKNOWN) and files < count:
            raise ValueError(f"{self.kind}: {files} files cannot be split across {count} ranks x workers: "
                             "some would read nothing")  # fmt: skip
        if count > 1 and self.shuffled and rank_and_world()[1] > 1 and not ctx.seeded:
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


def split_files(files: Dataset, by_rank: bool = True, by_worker: bool = True, *, shuffled: bool = False) -> Dataset:
    """``files`` (a dataset of file names) split across ranks and DataLoader workers.

    Args:
        files: the file names, the same list on every rank.
        by_rank: give each ``torch.distributed`` rank every ``ranks``-th file.
        by_worker: and each worker of a torch DataLoader iterating the pipeline its share of those.
        shuffled: say that ``files`` was shuffled with the pipeline seed, so a pass across
            ranks without a seed fails instead of giving ranks overlapping files.
    """
    _check_bool("split_files", "by_rank", by_rank)
    _check_bool("split_files", "by_worker", by_worker)
    if not isinstance(files, Dataset):
        raise TypeError(f"split_files: expected a tp.Dataset of file names, got {type(files).__name__}")
    return Dataset(SplitFilesNode(files._node, by_rank, by_worker, shuffled))

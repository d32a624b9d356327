"""Exactly once under a killed worker: every element once, in order, for map-style and iterable
datasets, pipelines and the DataLoader, on threads and on processes (torchpipe.testing's harness)."""

import time

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import torchpipe as tp
from torchpipe.testing import assert_exactly_once


class Rows(torch.utils.data.Dataset):
    """Map-style rows that take a moment (so the kill lands while batches are in flight)."""

    def __len__(self):
        return 240

    def __getitem__(self, i):
        time.sleep(0.001)
        return {"i": i, "x": torch.full((3,), float(i))}


class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, 240, step):
            time.sleep(0.001)
            yield {"i": i, "x": torch.full((3,), float(i))}


def _slow_square(x):
    time.sleep(0.001)
    return x * x


def _shard(i):
    return tp.range(i * 10, i * 10 + 10).map(_slow_square)


LOADERS = {
    "map-style, 2 workers": lambda: tp.DataLoader(Rows(), batch_size=8, num_workers=2),
    "map-style, shuffled, 2 workers": lambda: tp.DataLoader(
        Rows(),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
    ),
    "iterable, 2 workers": lambda: tp.DataLoader(Stream(), batch_size=8, num_workers=2),
    "iterable, auto": lambda: tp.DataLoader(Stream(), batch_size=8, num_workers="auto"),
    "pipeline in a DataLoader": lambda: tp.DataLoader(
        tp.range(240).map(_slow_square, 2, executor="process"), batch_size=8
    ),
}
PIPELINES = {
    "map on processes": lambda: tp.range(240).map(_slow_square, 2, executor="process"),
    "from_dataset, map and batch fused on processes": lambda: (
        tp.from_dataset(Rows()).map(lambda r: r["i"], 2, executor="process").batch(8)
    ),
    "interleave on processes": lambda: tp.range(24).interleave(
        _shard, cycle_length=4, num_parallel_calls=4, executor="process"
    ),
    "map on threads": lambda: tp.range(240).map(_slow_square, 4, executor="thread"),
}

SQUARES = [x * x for x in range(240)]  # what the maps must yield, known without running them
EXPECTED = {"map on processes": SQUARES, "map on threads": SQUARES}


@pytest.mark.parametrize("name", list(LOADERS))
def test_a_dataloader_loses_and_repeats_nothing_when_a_worker_is_killed(name):
    killed = assert_exactly_once(LOADERS[name], seed=len(name))
    assert killed is not None  # these run on worker processes: one was killed


@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_pipeline_loses_and_repeats_nothing_when_a_worker_is_killed(name):
    killed = assert_exactly_once(PIPELINES[name], seed=len(name), expected=EXPECTED.get(name))
    assert (killed is None) == (name == "map on threads")


def test_unordered_pipelines_are_compared_as_multisets():
    make = lambda: tp.range(240).map(_slow_square, 2, executor="process", deterministic=False)  # noqa: E731
    assert assert_exactly_once(make, ordered=False, expected=SQUARES) is not None

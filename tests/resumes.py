"""Pipelines and a DataLoader that tests checkpoint in one process and resume in another.

Run as ``python -m tests.resumes STATES OUT``: loads the ``torch.save``-d dict
``{(kind, name): state}``, resumes each one in this fresh process and ``torch.save``-s
``{(kind, name): the rest of its epoch}`` to ``OUT``.
"""

import sys

import torch
from torch.utils.data import TensorDataset

import torchpipe as tp


def _plus_one(x):
    return x + 1


def _with_a_draw(x):
    return x, int(tp.rng().integers(1 << 30))


def _odd(x):
    return x % 2 == 1


def _shard(i):
    return tp.range(i * 10, i * 10 + 10).map(_plus_one)


PIPELINES = {
    "shuffle, map on processes, batch": lambda: (
        tp.range(48)
        .shuffle(16)
        .map(_plus_one, 2, executor="process")
        .batch(4)
        .with_options(tp.Options(seed=3))
    ),
    "unseeded shuffle, random map on threads": lambda: (
        tp.range(30).shuffle(8).map(_with_a_draw, 2, executor="thread")
    ),
    "interleave, filter": lambda: (
        tp.range(6).interleave(_shard, cycle_length=3, num_parallel_calls=2).filter(_odd)
    ),
}


def loader():
    """A shuffling DataLoader on two worker processes."""
    data = TensorDataset(torch.arange(40.0))
    return tp.DataLoader(
        data, batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5)
    )


def resume(kind, name, state):
    """The rest of the epoch of pipeline ``name`` (``kind="pipeline"``) or of the loader from ``state``."""
    if kind == "loader":
        fresh = loader()
        fresh.load_state_dict(state)
        return list(fresh)
    it = iter(PIPELINES[name]())
    try:
        it.load_state_dict(state)
        return list(it)
    finally:
        it.close()


def main(states_path, out_path):
    states = torch.load(states_path)  # weights_only (the default): a state holds plain data only
    torch.save({key: resume(*key, state) for key, state in states.items()}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""reshard_states: the states of N ranks resumed on M, nothing lost or repeated, and what it refuses."""

import pickle

import pytest

import torchpipe as tp
from tests.distributed.test_ranks import Numbers, on_rank, write_files
from torchpipe.distributed.reshard import reshard_states


def _consume(iterators, steps):
    return [x for _ in range(steps) for it in iterators for x in next(it).tolist()]


@pytest.mark.parametrize("old, new, steps", [(2, 3, 3), (3, 2, 2), (2, 2, 1), (3, 1, 2)])
def test_reshard_states_resumes_on_another_number_of_ranks_with_nothing_lost_or_repeated(
    old, new, steps
):
    def make(rank, world_size):
        return on_rank(
            tp.from_dataset(Numbers(48)).shuffle(48).map(lambda x: x, 2).batch(2), rank, world_size
        )

    iterators = [iter(make(rank, old)) for rank in range(old)]
    seen = _consume(iterators, steps)
    states = [
        pickle.loads(pickle.dumps(it.state_dict())) for it in reversed(iterators)
    ]  # any order
    for rank, state in enumerate(reshard_states(states, new)):
        resumed = iter(make(rank, new))
        resumed.load_state_dict(state)
        seen += [x for batch in resumed for x in batch.tolist()]
    assert sorted(seen) == list(range(48))


def test_reshard_states_after_ranks_stopped_at_different_steps():
    def make(rank, world_size):
        return on_rank(tp.from_dataset(Numbers(30)).shuffle(30), rank, world_size)

    iterators = [iter(make(rank, 3)) for rank in range(3)]
    seen = [next(iterators[r]) for r in (0, 0, 0, 1, 2, 2)]
    twice = reshard_states([it.state_dict() for it in iterators], 2)
    states = reshard_states(twice, 4)  # holes carried through a second reshard
    for rank in range(4):
        it = iter(make(rank, 4))
        it.load_state_dict(states[rank])
        seen += list(it)
    assert sorted(seen) == list(range(30))


def test_reshard_states_with_global_batches_changes_the_batch_each_rank_takes():
    def make(rank, world_size):
        return on_rank(tp.range(48).shuffle(48).batch(12), rank, world_size, global_batch=True)

    iterators = [iter(make(rank, 2)) for rank in range(2)]
    seen = _consume(iterators, 2)
    for rank, state in enumerate(reshard_states([it.state_dict() for it in iterators], 3)):
        it = iter(make(rank, 3))
        it.load_state_dict(state)
        batches = list(it)
        assert [len(batch) for batch in batches] == [4, 4]
        seen += [x for batch in batches for x in batch.tolist()]
    assert sorted(seen) == list(range(48))


def test_reshard_states_refuses_what_it_cannot_reshard(tmp_path):
    def states_of(make, world_size=2):
        its = [iter(on_rank(make(), r, world_size)) for r in range(world_size)]
        for it in its:
            next(it)
        return [it.state_dict() for it in its]

    cases = [
        (
            lambda: tp.from_dataset(Numbers(20)).map(lambda x: x).shuffle(5),
            "shuffle.*above the share node",
        ),
        (lambda: tp.list_files(write_files(tmp_path, 4)), "level='file'"),
        (lambda: tp.zip(tp.range(8), tp.range(8)), "level='output'"),
    ]
    for make, message in cases:
        with pytest.raises(tp.CheckpointError, match=message):
            reshard_states(states_of(make), 3)
    good = states_of(lambda: tp.range(20).shuffle(20))
    with pytest.raises(tp.CheckpointError, match="one state from each of the old ranks"):
        reshard_states(good[:1], 3)
    with pytest.raises(tp.CheckpointError, match="not one pass"):
        reshard_states([good[0], states_of(lambda: tp.range(20).shuffle(20).take(9))[1]], 3)
    with pytest.raises(ValueError, match="world_size"):
        reshard_states(good, 0)


# -- global batches ------------------------------------------------------------------------------

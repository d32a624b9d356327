"""repeat, take, skip, shard, enumerate, scan, with_options: tf.data's elements and cardinality."""

import pytest
import torch

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip

# (pipeline, expected elements, expected cardinality); verified against tf.data 2.21
CASES = {
    "take-1": (lambda: tp.range(10).take(-1), list(range(10)), 10),
    "take0": (lambda: tp.range(10).take(0), [], 0),
    "take20": (lambda: tp.range(10).take(20), list(range(10)), 10),
    "skip-1": (lambda: tp.range(10).skip(-1), [], 0),
    "skip0": (lambda: tp.range(10).skip(0), list(range(10)), 10),
    "skip3": (lambda: tp.range(10).skip(3), list(range(3, 10)), 7),
    "skip20": (lambda: tp.range(10).skip(20), [], 0),
    "repeat0": (lambda: tp.range(3).repeat(0), [], 0),
    "repeat1": (lambda: tp.range(3).repeat(1), [0, 1, 2], 3),
    "repeat2": (lambda: tp.range(3).repeat(2), [0, 1, 2, 0, 1, 2], 6),
    "repeat_forever": (lambda: tp.range(3).repeat().take(8), [0, 1, 2, 0, 1, 2, 0, 1], 8),
    "repeat_empty_forever": (lambda: tp.range(0).repeat(), [], 0),
    "shard": (lambda: tp.range(10).shard(3, 2), [2, 5, 8], 3),
    "shard0": (lambda: tp.range(10).shard(3, 0), [0, 3, 6, 9], 4),
    "shard_one": (lambda: tp.range(4).shard(1, 0), [0, 1, 2, 3], 4),
    "enumerate": (lambda: tp.range(5, 8).enumerate(2), [(2, 5), (3, 6), (4, 7)], 3),
    "scan": (lambda: tp.range(5).scan(0, lambda s, x: (s + x, s * 2)), [0, 0, 2, 6, 12], 5),
    "rep_take": (lambda: tp.range(5).take(2).repeat(3), [0, 1] * 3, 6),
    "skip_rep": (lambda: tp.range(5).repeat(2).skip(3).take(5), [3, 4, 0, 1, 2], 5),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_elements_and_cardinality_match_tf_data(name):
    make, elements, cardinality = CASES[name]
    assert list(make()) == elements
    assert make().cardinality() == cardinality


@pytest.mark.parametrize(
    "make, cardinality",
    [
        (lambda: tp.range(5).filter(bool).repeat(), tp.INFINITE),
        (lambda: tp.range(5).filter(bool).repeat(2), tp.UNKNOWN),
        (lambda: tp.range(5).filter(bool).take(3), tp.UNKNOWN),
        (lambda: tp.range(5).repeat().skip(3), tp.INFINITE),
        (lambda: tp.range(5).repeat().take(3), 3),
        (lambda: tp.range(5).repeat().take(0), 0),
        (lambda: tp.range(5).repeat().repeat(0), 0),
        (lambda: tp.range(5).filter(bool).skip(-1), tp.UNKNOWN),
        (lambda: tp.range(10).shard(3, 1), 3),
        (lambda: tp.range(5).repeat().shard(2, 0), tp.INFINITE),
    ],
)
def test_cardinality_rules(make, cardinality):
    assert make().cardinality() == cardinality


def test_scan_carries_any_state_and_checks_the_return():
    ds = tp.range(4).scan([], lambda s, x: (s + [x], tuple(s)))
    assert list(ds) == [(), (0,), (0, 1), (0, 1, 2)]
    with pytest.raises(TypeError, match="new_state, output"):
        list(tp.range(2).scan(0, lambda s, x: s))


def test_repeat_rebuilds_its_input_each_time():
    made = []

    def gen():
        made.append(1)
        return iter([1, 2])

    assert list(tp.from_iterable(gen).repeat(3)) == [1, 2] * 3 and len(made) == 3


def test_with_options_is_transparent():
    ds = tp.range(3).with_options(tp.Options(seed=1))
    assert list(ds) == [0, 1, 2] and ds.cardinality() == 3 and "with_options" in ds.explain()


def test_more_options_do_not_change_the_random_draws_below_them():
    ds = tp.range(20).shuffle(8).map(lambda x: x + tp.rng().random()).with_options(tp.Options(seed=4))
    more = ds.with_options(tp.Options(deterministic=False)).with_options(tp.Options(restart_workers=False))
    assert list(ds) == list(more)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_roundtrip(name):
    assert_checkpoint_roundtrip(CASES[name][0]())


def test_checkpoint_across_repetitions_of_an_endless_repeat():
    assert_checkpoint_roundtrip(tp.range(4).enumerate().repeat().skip(2).shard(3, 1), max_elements=25)


class Reads(torch.utils.data.Dataset):
    """Records the indices read; index 3 is unreadable."""

    def __init__(self):
        self.read = []

    def __len__(self):
        return 10

    def __getitem__(self, i):
        self.read.append(i)
        if i == 3:
            raise ValueError("unreadable 3")
        return i


def _three_fails(x):
    if x == 3:
        raise ValueError("unreadable 3")
    return x


def test_shard_does_not_read_other_shards_elements_nor_raise_their_errors():
    items = Reads()
    assert list(tp.from_dataset(items).shard(2, 0)) == [0, 2, 4, 6, 8] and items.read == [0, 2, 4, 6, 8]
    assert list(tp.range(10).map(_three_fails).shard(2, 0)) == [0, 2, 4, 6, 8]  # computed, its error dropped
    with pytest.raises(ValueError, match="unreadable 3"):
        list(tp.from_dataset(Reads()).shard(2, 1))
    # the element that raised keeps its place: the shard goes on with its own
    assert list(tp.from_dataset(Reads()).shard(2, 1).ignore_errors()) == [1, 5, 7, 9]
    assert list(tp.range(10).map(_three_fails).shard(2, 1).ignore_errors()) == [1, 5, 7, 9]

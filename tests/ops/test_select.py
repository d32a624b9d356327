"""take, skip, shard: tf.data's elements and cardinality, checkpoints, and a shard reads only its own."""

import pytest
import torch

import torchpipe as tp
from tests.ops.tf_cases import tf_data_case_tests

# (pipeline, expected elements, expected cardinality); verified against tf.data 2.21
CASES = {
    "take-1": (lambda: tp.range(10).take(-1), list(range(10)), 10),
    "take0": (lambda: tp.range(10).take(0), [], 0),
    "take20": (lambda: tp.range(10).take(20), list(range(10)), 10),
    "skip-1": (lambda: tp.range(10).skip(-1), [], 0),
    "skip0": (lambda: tp.range(10).skip(0), list(range(10)), 10),
    "skip3": (lambda: tp.range(10).skip(3), list(range(3, 10)), 7),
    "skip20": (lambda: tp.range(10).skip(20), [], 0),
    "shard": (lambda: tp.range(10).shard(3, 2), [2, 5, 8], 3),
    "shard0": (lambda: tp.range(10).shard(3, 0), [0, 3, 6, 9], 4),
    "shard_one": (lambda: tp.range(4).shard(1, 0), [0, 1, 2, 3], 4),
    "rep_take": (lambda: tp.range(5).take(2).repeat(3), [0, 1] * 3, 6),
    "skip_rep": (lambda: tp.range(5).repeat(2).skip(3).take(5), [3, 4, 0, 1, 2], 5),
}


test_elements_and_cardinality_match_tf_data, test_checkpoint_roundtrip = tf_data_case_tests(CASES)


@pytest.mark.parametrize(
    "make, cardinality",
    [
        (lambda: tp.range(5).filter(bool).take(3), tp.UNKNOWN),
        (lambda: tp.range(5).repeat().take(3), 3),
        (lambda: tp.range(5).repeat().take(0), 0),
        (lambda: tp.range(5).filter(bool).skip(-1), tp.UNKNOWN),
        (lambda: tp.range(10).shard(3, 1), 3),
        (lambda: tp.range(5).repeat().shard(2, 0), tp.INFINITE),
    ],
)
def test_cardinality_rules(make, cardinality):
    assert make().cardinality() == cardinality


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
    assert list(tp.from_dataset(items).shard(2, 0)) == [0, 2, 4, 6, 8] and items.read == [
        0,
        2,
        4,
        6,
        8,
    ]
    assert list(tp.range(10).map(_three_fails).shard(2, 0)) == [
        0,
        2,
        4,
        6,
        8,
    ]  # computed, its error dropped
    with pytest.raises(ValueError, match="unreadable 3"):
        list(tp.from_dataset(Reads()).shard(2, 1))
    # the element that raised keeps its place: the shard goes on with its own
    assert list(tp.from_dataset(Reads()).shard(2, 1).ignore_errors()) == [1, 5, 7, 9]
    assert list(tp.range(10).map(_three_fails).shard(2, 1).ignore_errors()) == [1, 5, 7, 9]

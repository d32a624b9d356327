"""repeat: tf.data's elements and cardinality, a new pass of its input each time, checkpoints."""

import pytest

import torchpipe as tp
from tests.ops.tf_cases import tf_data_case_tests
from torchpipe.testing import assert_checkpoint_roundtrip

# (pipeline, expected elements, expected cardinality); verified against tf.data 2.21
CASES = {
    "repeat0": (lambda: tp.range(3).repeat(0), [], 0),
    "repeat1": (lambda: tp.range(3).repeat(1), [0, 1, 2], 3),
    "repeat2": (lambda: tp.range(3).repeat(2), [0, 1, 2, 0, 1, 2], 6),
    "repeat_forever": (lambda: tp.range(3).repeat().take(8), [0, 1, 2, 0, 1, 2, 0, 1], 8),
    "repeat_empty_forever": (lambda: tp.range(0).repeat(), [], 0),
}


test_elements_and_cardinality_match_tf_data, test_checkpoint_roundtrip = tf_data_case_tests(CASES)


@pytest.mark.parametrize(
    "make, cardinality",
    [
        (lambda: tp.range(5).filter(bool).repeat(), tp.INFINITE),
        (lambda: tp.range(5).filter(bool).repeat(2), tp.UNKNOWN),
        (lambda: tp.range(5).repeat().skip(3), tp.INFINITE),
        (lambda: tp.range(5).repeat().repeat(0), 0),
    ],
)
def test_cardinality_rules(make, cardinality):
    assert make().cardinality() == cardinality


def test_repeat_rebuilds_its_input_each_time():
    made = []

    def gen():
        made.append(1)
        return iter([1, 2])

    assert list(tp.from_iterable(gen).repeat(3)) == [1, 2] * 3 and len(made) == 3


def test_checkpoint_across_repetitions_of_an_endless_repeat():
    assert_checkpoint_roundtrip(
        tp.range(4).enumerate().repeat().skip(2).shard(3, 1), max_elements=25
    )

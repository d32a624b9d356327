"""enumerate and scan: tf.data's elements and cardinality, scan's state, checkpoints."""

import pytest

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip

# (pipeline, expected elements, expected cardinality); verified against tf.data 2.21
CASES = {
    "enumerate": (lambda: tp.range(5, 8).enumerate(2), [(2, 5), (3, 6), (4, 7)], 3),
    "scan": (lambda: tp.range(5).scan(0, lambda s, x: (s + x, s * 2)), [0, 0, 2, 6, 12], 5),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_elements_and_cardinality_match_tf_data(name):
    make, elements, cardinality = CASES[name]
    assert list(make()) == elements
    assert make().cardinality() == cardinality


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_roundtrip(name):
    assert_checkpoint_roundtrip(CASES[name][0]())


def test_scan_carries_any_state_and_checks_the_return():
    ds = tp.range(4).scan([], lambda s, x: (s + [x], tuple(s)))
    assert list(ds) == [(), (0,), (0, 1), (0, 1, 2)]
    with pytest.raises(TypeError, match="new_state, output"):
        list(tp.range(2).scan(0, lambda s, x: s))

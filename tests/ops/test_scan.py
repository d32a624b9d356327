"""enumerate and scan: tf.data's elements and cardinality, scan's state, checkpoints."""

import pytest

import torchpipe as tp
from tests.ops.tf_cases import tf_data_case_tests

# (pipeline, expected elements, expected cardinality); verified against tf.data 2.21
CASES = {
    "enumerate": (lambda: tp.range(5, 8).enumerate(2), [(2, 5), (3, 6), (4, 7)], 3),
    "scan": (lambda: tp.range(5).scan(0, lambda s, x: (s + x, s * 2)), [0, 0, 2, 6, 12], 5),
}


test_elements_and_cardinality_match_tf_data, test_checkpoint_roundtrip = tf_data_case_tests(CASES)


def test_scan_carries_any_state_and_checks_the_return():
    ds = tp.range(4).scan([], lambda s, x: (s + [x], tuple(s)))
    assert list(ds) == [(), (0,), (0, 1), (0, 1, 2)]
    with pytest.raises(TypeError, match="new_state, output"):
        list(tp.range(2).scan(0, lambda s, x: s))

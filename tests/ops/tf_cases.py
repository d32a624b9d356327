"""The two tests every structural op's table of tf.data cases gets: its elements and cardinality
as tf.data gives them, and a checkpoint round-trip at every element."""

import pytest

from torchpipe.testing import assert_checkpoint_roundtrip


def tf_data_case_tests(cases):
    """``(test_elements_and_cardinality_match_tf_data, test_checkpoint_roundtrip)`` over ``cases``:
    ``{name: (make a pipeline, expected elements, expected cardinality)}``; a test module assigns
    them to module-level names."""

    @pytest.mark.parametrize("name", sorted(cases))
    def test_elements_and_cardinality_match_tf_data(name):
        make, elements, cardinality = cases[name]
        assert list(make()) == elements
        assert make().cardinality() == cardinality

    @pytest.mark.parametrize("name", sorted(cases))
    def test_checkpoint_roundtrip(name):
        assert_checkpoint_roundtrip(cases[name][0]())

    return test_elements_and_cardinality_match_tf_data, test_checkpoint_roundtrip

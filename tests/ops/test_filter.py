import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip


def test_filter_accepts_bools_and_bool_scalars():
    assert list(tp.range(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    assert list(tp.range(6).filter(lambda x: torch.tensor(x > 3))) == [4, 5]
    assert list(tp.range(6).filter(lambda x: np.bool_(x < 2))) == [0, 1]
    assert list(tp.range(6).filter(lambda x: np.array([x == 2]))) == [2]
    assert list(tp.range(4).map(lambda x: (x, x % 2)).filter(lambda x, odd: odd == 1)) == [
        (1, 1),
        (3, 1),
    ]


@pytest.mark.parametrize("result", [1, None, "yes", torch.tensor([True, False]), torch.tensor(1)])
def test_filter_rejects_non_bool_predicates(result):
    with pytest.raises(TypeError, match=r"filter\(<lambda>\): the predicate must return a bool"):
        list(tp.range(3).filter(lambda x: result))


def test_take_while_stops_at_first_false_and_stays_stopped():
    calls = []

    def small(x):
        calls.append(x)
        return x < 3

    it = iter(tp.range(10).take_while(small))
    assert list(it) == [0, 1, 2]
    assert list(it) == [] and calls == [0, 1, 2, 3]
    assert tp.range(5).take_while(small).cardinality() == tp.UNKNOWN


def test_ignore_errors_drops_and_counts():
    def fragile(x):
        if x % 4 == 1:
            raise OSError("corrupt record")
        return x

    it = iter(tp.range(10).map(fragile).ignore_errors())
    assert list(it) == [0, 2, 3, 4, 6, 7, 8]
    counts = {s["stage"]: s for s in it.stats()}
    assert counts["ignore_errors"]["errors_ignored"] == 3
    assert counts["map(fragile)"]["produced"] == 7


def test_ignore_errors_with_parallel_map():
    def fragile(x):
        if x in (3, 5):
            raise ValueError(x)
        return x

    out = list(tp.range(9).map(fragile, num_parallel_calls=3).ignore_errors())
    assert out == [0, 1, 2, 4, 6, 7, 8]


def test_predicate_errors_carry_the_stage():
    with pytest.raises(ZeroDivisionError) as info:
        list(tp.range(3).filter(lambda x: 1 / (x - 1) > 0))
    assert "filter(<lambda>)" in info.value.__notes__[0] and "element 1" in info.value.__notes__[0]


def test_checkpoints():
    assert_checkpoint_roundtrip(tp.range(30).filter(lambda x: x % 4 != 1))
    assert_checkpoint_roundtrip(tp.range(30).take_while(lambda x: x < 17))
    assert_checkpoint_roundtrip(tp.range(12).map(lambda x: 1 // (x % 5)).ignore_errors())
    assert_checkpoint_roundtrip(tp.range(5).filter(lambda x: x != 2).repeat(3))

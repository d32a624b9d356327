import pytest

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only


def coin(x):
    return bool(tp.rng().random() < 0.6)


def odd(x):
    return x % 2 == 1


def test_filters_fuse_and_each_keeps_its_own_count_and_seed():
    ds = tp.range(60).filter(coin).filter(odd).filter(coin).with_options(tp.Options(seed=5))
    kept = assert_pass_keeps_output(ds, "filter_fusion")
    assert 0 < len(kept) < 30 and all(x % 2 for x in kept)
    text = only(ds, "filter_fusion").explain()
    assert "filter_fusion: filter(coin) + filter(odd) + filter(coin) -> one stage, inline" in text


def test_a_predicate_must_return_a_bool():
    ds = only(tp.range(3).filter(odd).filter(lambda x: x), "filter_fusion")
    with pytest.raises(TypeError, match="must return a bool"):
        list(ds)

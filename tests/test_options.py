import pickle

import pytest

import torchpipe as tp


def test_defaults_and_set_fields():
    o = tp.Options()
    assert o.seed is None and o.deterministic is True
    assert not o.is_set("seed")
    assert tp.Options(seed=3).is_set("seed")


def test_merge_later_set_fields_win_and_unset_fields_keep():
    merged = tp.Options(seed=1).merge(tp.Options(deterministic=False))
    assert merged.seed == 1 and merged.deterministic is False
    assert tp.Options(seed=1).merge(tp.Options(seed=2)).seed == 2
    # an explicitly set default still overrides
    assert (
        tp.Options(deterministic=False).merge(tp.Options(deterministic=True)).deterministic is True
    )


def test_with_options_merges_along_the_pipeline():
    ds = (
        tp.range(3)
        .with_options(tp.Options(seed=5))
        .map(lambda x: x)
        .with_options(tp.Options(deterministic=False))
    )
    assert ds.options() == tp.Options(seed=5, deterministic=False)
    zipped = tp.zip(tp.range(2).with_options(tp.Options(seed=1)), tp.range(2))
    assert zipped.options().seed == 1


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"sead": 1}, TypeError),
        ({"seed": "1"}, TypeError),
        ({"seed": True}, TypeError),
        ({"seed": -1}, ValueError),
        ({"deterministic": 1}, TypeError),
    ],
)
def test_bad_options(kwargs, error):
    with pytest.raises(error):
        tp.Options(**kwargs)


def test_immutable_hashable_picklable():
    o = tp.Options(seed=1)
    with pytest.raises(AttributeError):
        o.seed = 2
    assert hash(o) == hash(tp.Options(seed=1))
    assert pickle.loads(pickle.dumps(o)) == o
    assert "seed=1" in repr(o)
    with pytest.raises(TypeError):
        o.merge({"seed": 2})

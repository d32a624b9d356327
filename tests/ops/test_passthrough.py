"""with_options: transparent to the elements, and options added above do not change the draws below."""

import torchpipe as tp


def test_with_options_is_transparent():
    ds = tp.range(3).with_options(tp.Options(seed=1))
    assert list(ds) == [0, 1, 2] and ds.cardinality() == 3 and "with_options" in ds.explain()


def test_more_options_do_not_change_the_random_draws_below_them():
    ds = (
        tp.range(20)
        .shuffle(8)
        .map(lambda x: x + tp.rng().random())
        .with_options(tp.Options(seed=4))
    )
    more = ds.with_options(tp.Options(deterministic=False)).with_options(
        tp.Options(restart_workers=False)
    )
    assert list(ds) == list(more)

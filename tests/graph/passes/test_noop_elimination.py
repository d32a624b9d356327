import pytest

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only
from torchpipe.ops.passthrough import ElidedNode


def noisy(x):
    return x + float(tp.rng().random())


@pytest.mark.parametrize(
    "noop",
    [
        lambda ds: ds.take(-1),
        lambda ds: ds.skip(0),
        lambda ds: ds.repeat(1),
        lambda ds: ds.prefetch(0),
        lambda ds: ds.shard(1, 0),
        lambda ds: ds.take(-1).skip(0).repeat(1),
    ],
    ids=["take", "skip", "repeat", "prefetch", "shard", "stacked"],
)
def test_noops_are_removed_and_seeds_below_them_kept(noop):
    seeded = tp.Options(seed=4)
    ds = noop(tp.range(12).shuffle(5).map(noisy)).map(noisy).with_options(seeded)
    assert_pass_keeps_output(ds, "noop_elimination")
    it = iter(only(ds, "noop_elimination"))
    next(it)
    stages = [s["stage"] for s in it.stats()]
    assert stages == [
        "map(noisy)",
        "map(noisy)",
        "shuffle",
        "range",
    ]  # no iterator left for the no-op


def test_repeat_one_inside_a_repeat_keeps_per_repetition_seeds():
    ds = tp.range(6).shuffle(6).repeat(1).repeat(3).with_options(tp.Options(seed=1))
    assert_pass_keeps_output(ds, "noop_elimination")


@pytest.mark.parametrize(
    "op",
    [
        lambda ds: ds.take(3),
        lambda ds: ds.skip(1),
        lambda ds: ds.repeat(2),
        lambda ds: ds.prefetch(1),
        lambda ds: ds.shard(2, 0),
    ],
)
def test_ops_that_do_something_stay(op):
    assert_pass_keeps_output(op(tp.range(5)), "noop_elimination", applies=False, roundtrip=False)


def test_elided_nodes_are_not_shown_as_running():
    text = tp.range(3).take(-1).explain()
    assert "noop_elimination: take(count=-1) -> removed" in text
    running = text.split("As it will run:")[1].split("Cardinality:")[0]
    assert "take" not in running and not isinstance(
        only(tp.range(3).take(-1), "noop_elimination"), ElidedNode
    )

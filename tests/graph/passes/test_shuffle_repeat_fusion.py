import pytest

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only


@pytest.mark.parametrize("reshuffle", [True, False])
@pytest.mark.parametrize("seed", [None, 7])
def test_same_order_as_shuffle_then_repeat(reshuffle, seed):
    ds = tp.range(10).shuffle(4, seed=seed, reshuffle_each_iteration=reshuffle).repeat(3)
    elements = assert_pass_keeps_output(
        ds.with_options(tp.Options(seed=3)), "shuffle_repeat_fusion"
    )
    assert sorted(elements) == sorted(list(range(10)) * 3)
    for k in range(3):  # epoch boundaries are kept
        assert sorted(elements[10 * k : 10 * (k + 1)]) == list(range(10))


def test_one_shuffle_iterator_serves_every_repetition():
    it = iter(only(tp.range(5).shuffle(5).repeat(4), "shuffle_repeat_fusion"))
    head = [next(it) for _ in range(18)]  # in the fourth repetition
    produced = {entry["stage"]: entry["produced"] for entry in it.stats()}
    # one shuffle for all; its input anew
    assert produced["shuffle"] == 18 and produced["range"] == 5
    assert len(head) + len(list(it)) == 20


def test_forever_and_empty_inputs():
    ds = tp.range(3).shuffle(2).repeat(-1).take(10).with_options(tp.Options(seed=0))
    assert_pass_keeps_output(ds, "shuffle_repeat_fusion")
    assert list(only(tp.range(0).shuffle(2).repeat(-1), "shuffle_repeat_fusion")) == []


def test_shuffled_indices_still_push_down_to_workers():
    import torch

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 9

        def __getitem__(self, i):
            return i

    ds = (
        tp.from_dataset(Items())
        .shuffle(9)
        .repeat(2)
        .map(lambda x: x * 10, 2)
        .with_options(tp.Options(seed=2))
    )
    assert_pass_keeps_output(ds, "shuffle_repeat_fusion")
    text = only(ds, "shuffle_repeat_fusion", "source_pushdown").explain()
    assert (
        "source_pushdown: from_dataset(dataset='Items', len=9) through shuffle_repeat -> fetched"
        in text
    )

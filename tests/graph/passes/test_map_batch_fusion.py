"""Map+batch fusion: one task per batch, same output as unfused."""

import os

import pytest
import torch

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites
from torchpipe.graph.passes import map_batch_fusion
from torchpipe.ops.map import MapBatchNode
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements, node


class Items(torch.utils.data.Dataset):
    def __init__(self):
        self.batched_calls = 0

    def __len__(self):
        return 22

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i

    def __getitems__(self, indices):
        self.batched_calls += 1
        return [self[i] for i in indices]


def noisy(x, label):
    return x + float(tp.rng().random()), label, os.getpid()


def without_pids(batches):
    return [(x, y) for x, y, _ in batches]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_fused_output_equals_inline_output(executor):
    seeded = tp.Options(seed=2)
    fused = tp.from_dataset(Items()).map(noisy, 2, executor=executor).batch(5).with_options(seeded)
    inline = tp.from_dataset(Items()).map(noisy).batch(5).with_options(seeded)
    assert_same_elements(without_pids(fused), without_pids(inline))
    assert (
        "map_batch_fusion: batch(batch_size=5, drop_remainder=False) -> fused into map("
        in fused.explain()
    )


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_on_and_off_agree(executor):
    ds = tp.range(23).map(lambda x: x + tp.rng().random(), 2, executor=executor).batch(4)
    assert_pass_keeps_output(ds.with_options(tp.Options(seed=8)), "map_batch_fusion")


def test_a_chain_with_a_filter_is_not_fused_with_the_batch():
    ds = tp.range(20).map(abs, 2).filter(lambda x: x % 3 > 0).batch(4)
    on = only(ds, "map_filter_fusion", "map_batch_fusion")
    assert "map_batch_fusion" not in rewrites(on)
    assert [b.tolist() for b in on] == [b.tolist() for b in only(ds)]


def test_workers_collate_whole_batches_with_getitems():
    items = Items()
    batches = list(
        tp.from_dataset(items).map(noisy, 2, executor="process").batch(4, drop_remainder=True)
    )
    assert len(batches) == 5 and all(
        pid != os.getpid() for *_, pids in batches for pid in pids.tolist()
    )
    thread_items = Items()
    list(tp.from_dataset(thread_items).map(noisy, 2, executor="thread").batch(4))
    assert thread_items.batched_calls == 6  # one __getitems__ per batch, 22 = 5 * 4 + 2


def test_collate_fn_runs_in_the_task():
    ds = (
        tp.range(7)
        .map(lambda x: x * x, 2, executor="process")
        .batch(3, collate_fn=lambda xs: sum(xs))
    )
    assert list(ds) == [5, 50, 36]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_fused_checkpoint_roundtrip(executor):
    ds = tp.from_dataset(Items()).map(lambda x, y: y * 2, 2, executor=executor).batch(4)
    assert_checkpoint_roundtrip(ds)
    assert_checkpoint_roundtrip(tp.range(9).map(abs, 2, executor=executor).batch(2).repeat(2))


def test_rewrite_copies_only_what_changes():
    inner = tp.range(10).map(abs, 2).batch(3)
    root = node(inner.take(2))
    written = root.inputs[0]
    notes = []
    fused = map_batch_fusion.apply(root, tp.Options(), notes)
    assert fused is not root and isinstance(fused.inputs[0], MapBatchNode) and len(notes) == 1
    assert root.inputs[0] is written  # the graph as written is untouched
    plain = node(tp.range(5).map(abs).batch(2).filter(bool))
    assert map_batch_fusion.apply(plain, tp.Options(), []) is not plain  # sequential maps too


def test_a_sequential_map_fused_with_its_batch_gives_what_it_gives_unfused():
    """Inline, in order, on the consumer's thread: the same batches, the same tp.rng() draws and
    global RNG draws of a seeded pipeline, a stateful function seeing its elements in order."""
    import threading

    seen = []

    def stateful(x, label):
        seen.append((label, threading.get_ident()))
        return global_noise(x + float(tp.rng().random()), label)

    ds = tp.from_dataset(Items()).map(stateful).batch(5).with_options(tp.Options(seed=4))
    assert "map_batch_fusion" in rewrites(ds)
    assert_pass_keeps_output(ds, "map_batch_fusion")
    seen.clear()
    batches = list(ds)
    assert [label for label, _ in seen] == list(range(22))
    assert {ident for _, ident in seen} == {threading.get_ident()}
    assert [b[1].tolist() for b in batches][-1] == [20, 21]
    assert_checkpoint_roundtrip(ds)
    assert_checkpoint_roundtrip(tp.range(9).map(abs).batch(2).repeat(2))


def test_an_error_in_a_fused_sequential_map_names_its_element():
    def fails_at_seven(x):
        if x == 7:
            raise ValueError("seven")
        return x

    it = iter(tp.range(10).map(fails_at_seven).batch(4))
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="seven") as raised:
        next(it)
    assert "map(fails_at_seven) at element 7" in "\n".join(raised.value.__notes__)
    assert [b.tolist() for b in it] == [[8, 9]]
    skipped = tp.range(10).map(fails_at_seven).batch(4).ignore_errors()
    assert [b.tolist() for b in skipped] == [[0, 1, 2, 3], [8, 9]]


def _fails_at_five(x):
    if x == 5:
        raise ValueError("five")
    return x + tp.rng().random()


@pytest.mark.parametrize("fused_first", [True, False])
def test_a_fused_sequential_map_and_the_unfused_pair_load_each_others_checkpoints(fused_first):
    """The inputs after a failed element start the next batch, as unfused; a checkpoint taken
    there (the fused one keeps them under "pending") resumes in either form."""
    ds = tp.range(14).map(_fails_at_five).batch(4).with_options(tp.Options(seed=1))
    forms = (ds, only(ds)) if fused_first else (only(ds), ds)
    it = iter(forms[0])
    first = next(it)
    with pytest.raises(ValueError, match="five"):
        next(it)
    state = it.state_dict()
    rest = [b.tolist() for b in it]
    assert [int(x) for b in rest for x in b] == [6, 7, 8, 9, 10, 11, 12, 13]
    assert next(iter(forms[1])).tolist() == first.tolist()  # the same seeds either way
    resumed = iter(forms[1])
    if fused_first:  # the unfused pair cannot hold the inputs over: it says so
        with pytest.raises(tp.CheckpointError, match="map_batch_fusion optimization on"):
            resumed.load_state_dict(state)
        resumed = iter(forms[0])
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    # between two batches, with nothing held over: either way
    ds = tp.range(14).map(_noise).batch(4).with_options(tp.Options(seed=1))
    forms = (ds, only(ds)) if fused_first else (only(ds), ds)
    it = iter(forms[0])
    next(it)
    state = it.state_dict()
    resumed = iter(forms[1])
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in it]


def _noise(x):
    return x + tp.rng().random()


def global_noise(x, label):
    import random

    import numpy as np

    return x + random.random() + float(np.random.rand()) + float(torch.rand(())), label


def test_global_rngs_match_inline_when_fused_in_processes():
    seeded = tp.Options(seed=5)
    fused = (
        tp.from_dataset(Items())
        .map(global_noise, 2, executor="process")
        .batch(4)
        .with_options(seeded)
    )
    inline = tp.from_dataset(Items()).map(global_noise).batch(4).with_options(seeded)
    assert_same_elements(list(fused), list(inline))


def test_auto_executor_with_fusion_returns_plain_tensors():
    def heavy(x):
        total = 0
        for i in range(30_000):
            total += i
        return torch.full((2,), x + total % 1)

    batches = list(tp.range(40).map(heavy, 2).batch(8))  # executor="auto" runs some inline first
    assert all(type(b) is torch.Tensor for b in batches)
    assert torch.equal(torch.cat(batches)[:, 0], torch.arange(40.0))

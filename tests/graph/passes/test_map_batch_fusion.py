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
    plain = node(tp.range(5).map(abs).batch(2))
    assert map_batch_fusion.apply(plain, tp.Options(), []) is plain  # sequential maps are not fused


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

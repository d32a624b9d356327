import os

import torch

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites, run_labels


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return i, os.getpid()


def noisy(i, pid):
    return i + tp.rng().random(), pid


def test_fetches_run_in_the_workers_and_output_is_the_same():
    ds = (
        tp.from_dataset(Items())
        .shuffle(5)
        .take(10)
        .map(noisy, 2, executor="process")
        .with_options(tp.Options(seed=1))
    )
    on, off = list(only(ds, "source_pushdown")), list(only(ds))
    assert all(pid != os.getpid() for _, pid in on) and all(pid == os.getpid() for _, pid in off)
    assert [x for x, _ in on] == [x for x, _ in off]
    assert any("[source pushed down]" in label for label in run_labels(only(ds, "source_pushdown")))


def test_checkpoints_resume_on_indices():
    ds = tp.from_dataset(Items()).shuffle(4).map(lambda i, pid: i, 2, executor="thread")
    ds = ds.with_options(tp.Options(seed=2))
    assert_pass_keeps_output(ds, "source_pushdown")


def test_not_through_ops_that_change_elements():
    ds = tp.from_dataset(Items()).map(lambda i, pid: i).map(abs, 2)
    assert "source_pushdown" not in rewrites(only(ds, "source_pushdown"))

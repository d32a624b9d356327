"""SharedSequence: items come back equal, it reads like a sequence, and a forked worker that reads
every item copies none of the parent's pages (a list of the same items is copied)."""

import multiprocessing
import pickle

import psutil
import pytest
import torch

import torchpipe as tp


@pytest.mark.parametrize(
    "items",
    [
        ["a/b.jpg", "", "héllo", "\udcff"],
        [b"\x00\x01", b"", b"x" * 1000],
        [{"label": 3, "box": [1.0, 2.0]}, ("path", 7), None, "mixed", b"bytes"],
        [],
    ],
    ids=["str", "bytes", "pickle", "empty"],
)
def test_items_come_back_equal_in_order(items):
    seq = tp.SharedSequence(iter(items))
    assert len(seq) == len(items)
    assert list(seq) == items
    assert [seq[i] for i in range(-len(items), 0)] == items
    assert pickle.loads(pickle.dumps(seq))[:] == items


def test_reads_like_a_sequence():
    seq = tp.SharedSequence(range(10))
    assert seq[2:8:3] == [2, 5]
    assert seq[::-1] == list(range(9, -1, -1))
    assert 7 in seq and 11 not in seq
    assert seq.index(4) == 4
    assert "10 items as pickle" in repr(seq)
    assert seq.nbytes > 0


def test_each_read_is_a_new_object():
    seq = tp.SharedSequence([{"a": [1]}])
    seq[0]["a"].append(2)
    assert seq[0] == {"a": [1]}


def test_bad_index_and_unpicklable_items_fail_clearly():
    seq = tp.SharedSequence(["x"])
    with pytest.raises(IndexError, match="index 1 out of range for 1 items"):
        seq[1]
    with pytest.raises(IndexError):
        seq[-2]
    with pytest.raises(TypeError, match="integers or slices, not str"):
        seq["0"]
    with pytest.raises(TypeError, match="item 1 .*cannot be pickled"):
        tp.SharedSequence([1, lambda: 0])
    with pytest.raises(TypeError):
        seq[0] = "y"


class _Samples(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        return len(path), label


def test_torch_workers_read_it():
    samples = [(f"img_{i}.jpg", i % 3) for i in range(40)]
    loader = tp.DataLoader(_Samples(tp.SharedSequence(samples)), batch_size=8, num_workers=2)
    lengths, labels = zip(*[(x, y) for batch in loader for x, y in zip(*batch)])
    assert list(labels) == [label for _, label in samples]
    assert list(lengths) == [len(path) for path, _ in samples]


def _read_all_and_report_growth(samples, out):
    before = psutil.Process().memory_full_info().uss
    total = 0
    for i in range(len(samples)):
        total += samples[i]["label"]
    out.put((psutil.Process().memory_full_info().uss - before, total))


def _child_growth(samples):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_all_and_report_growth, args=(samples, out))
    child.start()
    growth, total = out.get(timeout=60)
    child.join(timeout=30)
    return growth, total


def test_a_forked_reader_copies_no_pages_where_a_list_is_copied():
    items = [{"label": i % 1000, "path": f"train/{i:07d}.jpg"} for i in range(200_000)]
    expected = sum(item["label"] for item in items)
    list_growth, list_total = _child_growth(items)
    shared_growth, shared_total = _child_growth(tp.SharedSequence(items))
    assert list_total == shared_total == expected
    # 200k dicts and strings: the list copies ~18 MB of pages (the dicts, written by the reads)
    assert list_growth > 10 << 20, list_growth
    assert shared_growth < 3 << 20, shared_growth

"""The public source functions: argument checking and what they yield."""

import collections
import os

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.testing import assert_same_elements

Pair = collections.namedtuple("Pair", "a b")


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return i * i


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_from_dataset_yields_every_index_in_order():
    ds = tp.from_dataset(Squares())
    assert list(ds) == [0, 1, 4, 9, 16] and len(ds) == 5
    assert list(tp.from_dataset([3, 1, 2])) == [3, 1, 2]


@pytest.mark.parametrize("bad", [Stream(), 5, iter([1])])
def test_from_dataset_rejects_non_map_style(bad):
    with pytest.raises(TypeError, match="from_dataset"):
        tp.from_dataset(bad)


def test_from_iterable_calls_a_callable_every_epoch():
    calls = []

    def gen():
        calls.append(1)
        yield from range(3)

    ds = tp.from_iterable(gen)
    assert list(ds) == [0, 1, 2] and list(ds) == [0, 1, 2] and len(calls) == 2
    assert ds.cardinality() == tp.UNKNOWN
    assert tp.from_iterable([1, 2]).cardinality() == 2
    assert list(tp.from_iterable(Stream())) == [0, 1, 2]
    with pytest.raises(TypeError):
        tp.from_iterable(5)
    with pytest.raises(TypeError, match="must return an iterable"):
        list(tp.from_iterable(lambda: 5))


def test_from_tensor_slices_keeps_structure():
    t = torch.arange(6).reshape(3, 2)
    a = np.array([1.5, 2.5, 3.5], dtype=np.float32)
    ds = tp.from_tensor_slices({"t": t, "pair": Pair(a, ["x", "y", "z"])})
    out = list(ds)
    assert len(out) == 3 == len(ds)
    assert torch.equal(out[1]["t"], torch.tensor([2, 3]))
    assert (
        type(out[2]["pair"]) is Pair
        and out[2]["pair"].b == "z"
        and out[2]["pair"].a == np.float32(3.5)
    )
    assert list(tp.from_tensor_slices([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert_same_elements(
        tp.from_tensor_slices((torch.arange(2), torch.ones(2))),
        [(torch.tensor(0), torch.tensor(1.0)), (torch.tensor(1), torch.tensor(1.0))],
    )


@pytest.mark.parametrize(
    "bad, match",
    [
        ((torch.arange(3), torch.arange(4)), "differ"),
        (torch.tensor(1), "0-d"),
        ((), "no components"),
        (("abc",), "tensors, arrays or lists"),
        (5, "tensors, arrays or lists"),
    ],
)
def test_from_tensor_slices_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        tp.from_tensor_slices(bad)


def test_range_like_python():
    assert list(tp.range(4)) == [0, 1, 2, 3]
    assert list(tp.range(2, 9, 3)) == [2, 5, 8]
    assert list(tp.range(5, 0, -2)) == [5, 3, 1]
    assert tp.range(5, 0, -2).cardinality() == 3
    with pytest.raises(ValueError, match="step"):
        tp.range(0, 5, 0)
    with pytest.raises(TypeError):
        tp.range(1.5)
    with pytest.raises(TypeError):
        tp.range()


def test_list_files(tmp_path):
    for name in ["b.txt", "a.txt", "c.bin"]:
        (tmp_path / name).write_text(name)
    files = list(tp.list_files(str(tmp_path / "*.txt")))
    assert files == [os.path.join(tmp_path, "a.txt"), os.path.join(tmp_path, "b.txt")]
    both = list(tp.list_files([str(tmp_path / "*.txt"), str(tmp_path / "*.bin")]))
    assert len(both) == 3 and both == sorted(both)
    shuffled = tp.list_files(str(tmp_path / "*"), shuffle=True, seed=3)
    assert sorted(shuffled) == sorted(both)
    with pytest.raises(ValueError, match="no files match"):
        tp.list_files(str(tmp_path / "*.none"))
    with pytest.raises(TypeError):
        tp.list_files(5)


def test_zip_and_choose_and_sample_validate_arguments():
    with pytest.raises(TypeError):
        tp.zip(tp.range(2), [1, 2])
    with pytest.raises(ValueError):
        tp.zip()
    with pytest.raises(TypeError):
        tp.choose_from_datasets([], tp.range(2))
    with pytest.raises(TypeError):
        tp.choose_from_datasets([tp.range(2)], [0, 0])
    with pytest.raises(ValueError, match="weights"):
        tp.sample_from_datasets([tp.range(2)], weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="positive"):
        tp.sample_from_datasets([tp.range(2), tp.range(2)], weights=[0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        tp.sample_from_datasets([tp.range(2), tp.range(2)], weights=[-1, 2])


def test_zip_structures():
    assert list(tp.zip(tp.range(2))) == [0, 1]
    assert list(tp.zip((tp.range(2),))) == [(0,), (1,)]
    assert list(tp.zip({"a": tp.range(2), "b": (tp.range(3), tp.range(4))})) == [
        {"a": 0, "b": (0, 0)},
        {"a": 1, "b": (1, 1)},
    ]
    with pytest.raises(TypeError, match="use a tuple"):
        tp.zip([tp.range(2), tp.range(2)])

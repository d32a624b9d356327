"""Source iterators: checkpoints and resume behaviour."""

import pytest
import torch

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 9

    def __getitem__(self, i):
        return {"x": torch.full((2,), i), "i": i}


class Batched(Items):
    """A dataset with torch's batched fetch, counting its calls."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, i):
        raise AssertionError("__getitems__ should be used")

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        return [{"x": torch.full((2,), i), "i": i} for i in indices]


def test_a_batch_of_a_dataset_is_fetched_with_one_getitems_call():
    dataset = Batched()
    batches = list(tp.from_dataset(dataset).batch(4))
    assert [b["i"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert dataset.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.range(7),
        lambda: tp.range(20, 3, -4),
        lambda: tp.from_dataset(Items()),
        lambda: tp.from_dataset(Items()).batch(4),
        lambda: tp.from_dataset(Batched()).batch(4),
        lambda: tp.from_tensor_slices((torch.arange(6), [str(i) for i in range(6)])),
        lambda: tp.from_iterable(lambda: iter(range(8))),
        lambda: tp.from_iterable([1, 2, 3]),
    ],
)
def test_source_checkpoints(make):
    assert_checkpoint_roundtrip(make())
    assert_checkpoint_roundtrip(make().repeat(2))


def test_iterable_resume_skips_consumed_elements_and_reports_shrunk_sources():
    data = list(range(10))
    ds = tp.from_iterable(lambda: iter(data))
    it = iter(ds)
    [next(it) for _ in range(6)]
    state = it.state_dict()
    del data[4:]
    resumed = iter(ds)
    resumed.load_state_dict(state)
    with pytest.raises(RuntimeError, match="cannot resume at element 6"):
        next(resumed)


def test_source_errors_propagate_with_their_type():
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            if i == 1:
                raise IndexError("missing file")
            return i

    it = iter(tp.from_dataset(Broken()))
    assert next(it) == 0
    with pytest.raises(IndexError, match="missing file"):
        next(it)
    assert list(it) == [2]
    # the batch fails; the next starts past the failing index
    batches = iter(tp.from_dataset(Broken()).batch(2))
    with pytest.raises(IndexError, match="missing file"):
        next(batches)
    assert [b.tolist() for b in batches] == [[2]]


class Corrupt(Items):
    """Index 5 is a truncated file, as a corrupt JPEG would be."""

    def __getitem__(self, i):
        if i == 5:
            raise OSError("Truncated File Read")
        return super().__getitem__(i)

    def __getitems__(self, indices):
        return [self[i] for i in indices]


class CorruptNoBatchFetch(Corrupt):
    __getitems__ = None


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: tp.from_dataset(ds),  # inline
        lambda ds: tp.from_dataset(ds).batch(2),  # inline, a batch's elements at once: __getitems__
        # pushed down, threads
        lambda ds: tp.from_dataset(ds).map(lambda x: x, 2, executor="thread"),
        # pushed down, processes
        lambda ds: tp.from_dataset(ds).map(lambda x: x, 2, executor="process"),
        lambda ds: (
            tp.from_dataset(ds).map(lambda x: x, 2, executor="process").batch(2)
        ),  # + batch: __getitems__
    ],
)
@pytest.mark.parametrize("dataset", [Corrupt(), CorruptNoBatchFetch()])
def test_getitem_errors_name_the_stage_and_the_index(make, dataset):
    with pytest.raises(OSError, match="Truncated File Read") as info:
        list(make(dataset))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"raised in torchpipe stage from_dataset({type(dataset).__name__}) at" in notes
    assert "index 5" in notes or "indices [4, 5]" in notes

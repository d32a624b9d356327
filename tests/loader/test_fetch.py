"""A batch fetched in this process: torch's collation, its large tensors in reused memory."""

import gc
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from torchpipe.loader.fetch import recycling_collate
from torchpipe.runtime.recycle import RecycledStack

ROWS = 8
LARGE = (3, 128, 128)  # 8 rows of float32: 1.5 MB, past RecycledStack's smallest
PLACED = (3, 192, 192)  # 432 KB of float32: placed in its row as it comes (PLACE_BYTES)


def _items(n, offset=0.0):
    def item(i):
        image, small, array = (
            torch.full(LARGE, float(i) + offset),
            torch.arange(3) + i,
            np.full(2, i, dtype=np.int16),
        )
        return {
            "image": image,
            "label": i,
            "name": f"x{i}",
            "small": small,
            "array": array,
            "pair": (torch.tensor(i), float(i)),
        }

    return [item(i) for i in range(n)]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_it_collates_as_torchs_default_collate_does():
    collate = recycling_collate(RecycledStack())
    assert _same(collate(_items(ROWS)), default_collate(_items(ROWS)))
    mixed = [torch.ones(LARGE, dtype=torch.int64), torch.ones(LARGE, dtype=torch.float32)]
    assert (
        collate(mixed).dtype == default_collate(mixed).dtype == torch.float32
    )  # promoted, as torch's stack does
    uneven = [torch.ones(2), torch.ones(3)]
    for fn in (collate, default_collate):
        with pytest.raises(RuntimeError, match="equal size"):
            fn(uneven)


def test_a_freed_batchs_memory_is_reused_and_a_kept_one_is_never_written():
    memory = RecycledStack()
    collate = recycling_collate(memory)
    first = collate(_items(ROWS))["image"]
    pointer = first.data_ptr()
    del first
    gc.collect()
    second = collate(_items(ROWS, offset=100.0))["image"]
    # the freed batch's buffer, pages already in
    assert second.data_ptr() == pointer and memory.reused == 1
    third = collate(_items(ROWS, offset=200.0))["image"]
    assert third.data_ptr() != second.data_ptr()
    assert torch.equal(second, torch.stack([torch.full(LARGE, i + 100.0) for i in range(ROWS)]))


class _Payloads(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"payload": bytes(4096), "i": i}


@pytest.mark.parametrize("num_workers", [0, "auto"])
def test_the_first_batch_sizes_the_heap_kept_between_batches(monkeypatch, num_workers):
    import torchpipe as tp
    from torchpipe.loader import fetch

    asked = []
    monkeypatch.setattr(fetch, "hold_free", asked.append)
    loader = tp.DataLoader(_Payloads(), batch_size=16, num_workers=num_workers)
    for _ in range(2):
        assert len(list(loader)) == 4
    # once an iterator, with what the batch holds in the heap: 16 payloads of 4 KB, 16 int64s;
    # and where batches are fetched here ("auto"), with what their elements hold until collated
    expected = {16 * 4096 + 16 * 8} | ({16 * 4096} if num_workers == "auto" else set())
    assert set(asked) == expected and len(asked) <= 2 * len(expected)


class _Fills(torch.utils.data.Dataset):
    """Elements of 256 KB: mapped by glibc at first, from its heap once it freed one."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((64, 1024), float(i))


def test_a_batch_fetched_here_has_its_elements_heap_kept_for_the_next(monkeypatch):
    """#59 item 7: the elements of a batch fetched in this process live until it is collated, and
    glibc gave their memory back after each batch, to fault it in again at the next
    (``bigtensor``: 9,200 page faults a batch inline). The first batch's elements size the heap
    kept free between batches; the later batches ask nothing more."""
    import torchpipe as tp
    from torchpipe.loader import fetch

    held = []
    monkeypatch.setattr(fetch, "hold_free", held.append)
    loader = tp.DataLoader(_Fills(), batch_size=4)
    local = fetch.LocalFetch(loader, 0, (), RecycledStack())
    for batch in range(3):
        out = local(batch, (0, batch, list(range(4 * batch, 4 * batch + 4))))
        assert out.shape == (4, 64, 1024) and out[0, 0, 0] == 4 * batch
    assert held == [4 * 64 * 1024 * 4]


class _LargeRows(torch.utils.data.Dataset):
    """Dicts with a 432 KB image (placed in its row), a small tensor and a string; element
    ``fails`` raises. Each element checks that the last one's image is gone by then: placed in
    its row of the batch as soon as it was fetched, not kept until the collation."""

    def __init__(self, fails=None):
        self.fails = fails
        self.last = None  # a weak reference to the last element's image
        self.kept_until_collated = 0

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == self.fails:
            raise OSError("Truncated File Read")
        if self.last is not None and self.last() is not None:
            self.kept_until_collated += 1
        image = torch.full(PLACED, float(i))
        self.last = weakref.ref(image)
        return {"image": image, "small": torch.arange(3) + i, "name": f"x{i}"}


def test_a_batch_made_here_places_each_element_in_its_row_as_it_is_fetched():
    import torchpipe as tp
    from torchpipe.loader import fetch

    dataset = _LargeRows()
    memory = RecycledStack()
    local = fetch.LocalFetch(tp.DataLoader(dataset, batch_size=ROWS), 0, (), memory)
    assert isinstance(local.fetcher, fetch.PlacingFetch)
    first = local(0, (0, 0, list(range(ROWS))))
    second = local(1, (0, 1, list(range(ROWS, 2 * ROWS))))
    for out, start in ((first, 0), (second, ROWS)):
        expected = default_collate([dataset[i] for i in range(start, start + ROWS)])
        assert _same(out, expected)
    # the elements' images went to their rows as they came (none kept until the collation), the
    # batch the user holds is not written by the next
    dataset.kept_until_collated = 0
    third = local(2, (0, 2, list(range(2 * ROWS, 3 * ROWS))))
    assert dataset.kept_until_collated == 0 and third["image"][0, 0, 0, 0] == 2 * ROWS
    assert torch.equal(first["image"][:, 0, 0, 0], torch.arange(ROWS, dtype=torch.float32))


def test_torchs_fetcher_keeps_the_elements_until_collated():
    # the case the placing fetch changes, and the datasets it leaves to torch's fetcher
    import torchpipe as tp
    from torchpipe.loader import fetch

    class Items(_LargeRows):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    dataset = Items()
    local = fetch.LocalFetch(tp.DataLoader(dataset, batch_size=ROWS), 0, (), RecycledStack())
    assert not isinstance(local.fetcher, fetch.PlacingFetch)
    local(0, (0, 0, list(range(ROWS))))
    assert dataset.kept_until_collated == ROWS - 1
    custom = tp.DataLoader(_LargeRows(), batch_size=ROWS, collate_fn=lambda rows: rows)
    assert not isinstance(
        fetch.LocalFetch(custom, 0, (), RecycledStack()).fetcher, fetch.PlacingFetch
    )


def test_an_error_while_placing_names_the_batch_and_the_index():
    import torchpipe as tp
    from torchpipe.testing import forced_call_costs

    loader = tp.DataLoader(_LargeRows(fails=13), batch_size=4, num_workers="auto")
    with forced_call_costs(1e-5, 0.0, moves=False):  # cheap batches: made here, placed
        batches = iter(loader)
    with pytest.raises(OSError, match="Truncated File Read") as caught:
        list(batches)
    assert (
        "raised in torchpipe stage DataLoader at batch 3, dataset index 13"
        in caught.value.__notes__
    )


def test_num_workers_0_places_each_element_in_its_row_too():
    import torchpipe as tp

    dataset = _LargeRows()
    loader = tp.DataLoader(dataset, batch_size=ROWS)
    batches = list(loader)
    assert dataset.kept_until_collated == 0 and len(batches) == len(dataset) // ROWS
    for k, batch in enumerate(batches):  # every batch kept: none written by a later one
        expected = default_collate([dataset[i] for i in range(k * ROWS, (k + 1) * ROWS)])
        assert _same(batch, expected)
    with pytest.raises(OSError, match="Truncated") as caught:
        list(tp.DataLoader(_LargeRows(fails=13), batch_size=4))
    assert (
        "raised in torchpipe stage DataLoader at batch 3, dataset index 13"
        in caught.value.__notes__
    )


class _LargeStream(torch.utils.data.IterableDataset):
    """``n`` elements as ``_LargeRows`` makes them, then the end (or ``fails`` raises there)."""

    def __init__(self, n, fails=None):
        self.rows, self.n = _LargeRows(fails), n

    def __iter__(self):
        return (self.rows[i] for i in range(self.n))


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_iterable_datasets_batches_place_their_rows_too(drop_last):
    import torchpipe as tp

    stream = _LargeStream(10)
    ours = list(tp.DataLoader(stream, batch_size=4, drop_last=drop_last))
    assert stream.rows.kept_until_collated == 0
    theirs = list(torch.utils.data.DataLoader(_LargeStream(10), batch_size=4, drop_last=drop_last))
    assert len(ours) == len(theirs) == (2 if drop_last else 3)
    assert all(_same(a, b) for a, b in zip(ours, theirs))  # the last, shorter one too
    with pytest.raises(OSError, match="Truncated"):
        list(tp.DataLoader(_LargeStream(10, fails=6), batch_size=4))

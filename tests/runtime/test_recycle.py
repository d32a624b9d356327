import gc
import json
import os
import threading
from collections import namedtuple

import pytest
import torch

import torchpipe as tp
from torchpipe.ops.collate import collate_in_stage
from torchpipe.runtime.heap import hold_free
from torchpipe.runtime.recycle import (
    RECHECK_EVERY,
    RecycledStack,
    batch_row,
    delivered,
    forget_batches_in_fork,
)
from torchpipe.testing import forced_call_costs, move_calls, stages

Pair = namedtuple("Pair", "image label")


def rows(n, shape=(3, 8), start=0):
    return [torch.full(shape, float(start + i)) for i in range(n)]


def test_a_stack_equals_torch_stack_and_its_memory_comes_back_when_the_batch_is_freed():
    memory = RecycledStack(min_bytes=1)
    batch = memory(rows(5))
    assert torch.equal(batch, torch.stack(rows(5))) and batch.is_contiguous()
    address = batch.data_ptr()
    del batch
    again = memory(rows(5, start=10))
    assert memory.reused == 1 and again.data_ptr() == address
    assert torch.equal(again, torch.stack(rows(5, start=10)))


@pytest.mark.parametrize("keep", ["row", "dtype view", "numpy slice", "storage"])
def test_memory_still_viewed_is_never_reused(keep):
    memory = RecycledStack(min_bytes=1)
    views = {
        "row": lambda b: b[2],
        "dtype view": lambda b: b.view(torch.int32),
        "numpy slice": lambda b: b.numpy()[1:],
        "storage": lambda b: b.untyped_storage(),
    }
    batch = memory(rows(4))
    held = views[keep](batch)
    expected = torch.stack(rows(4))
    del batch
    gc.collect()
    other = memory(rows(4, start=100))
    assert memory.reused == 0
    assert torch.equal(other, torch.stack(rows(4, start=100)))
    if keep == "storage":
        assert torch.equal(torch.tensor([], dtype=torch.float32).set_(held).view(4, 3, 8), expected)
    elif keep == "row":
        assert torch.equal(held, expected[2])
    elif keep == "dtype view":
        assert torch.equal(held.view(torch.float32), expected)
    else:
        assert (held == expected.numpy()[1:]).all()
    del held
    del other
    memory(rows(4))
    assert memory.reused == 1


def test_small_stacks_grad_and_bad_shapes_go_to_torch_stack():
    memory = RecycledStack(min_bytes=1 << 20)
    small = memory(rows(3))
    small.resize_(1)  # torch.stack's own memory: resizable
    parts = [torch.ones(512, 600, requires_grad=True) for _ in range(2)]
    memory(parts).sum().backward()
    assert parts[0].grad is not None
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        memory([torch.zeros(512, 600), torch.zeros(512, 601)])
    assert memory.reused == 0


def test_threads_stacking_at_once_get_their_own_memory():
    memory = RecycledStack(min_bytes=1)
    errors = []

    def work(k):
        for i in range(200):
            parts = rows(6, start=1000 * k + i)
            batch = memory(parts)
            if not torch.equal(batch, torch.stack(parts)):
                errors.append((k, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and memory.reused > 0


def test_placed_rows_make_the_batch_without_a_second_copy():
    memory = RecycledStack(min_bytes=1, place_bytes=1)
    elements = [Pair(torch.full((2, 4), float(i)), i) for i in range(3)]
    with memory.rows(4) as batch_rows:
        placed = [batch_rows.place(j, e) for j, e in enumerate(elements)]
        assert len(placed) == len(elements)
        assert all(
            type(p) is Pair and p.image.data_ptr() != e.image.data_ptr()
            for p, e in zip(placed, elements)
        )
        batch = collate_in_stage(placed, "batch", memory)
    assert type(batch) is Pair and batch.label.tolist() == [0, 1, 2]
    assert batch.image.data_ptr() == placed[0].image.data_ptr() and batch.image.shape == (
        3,
        2,
        4,
    )  # partial
    assert torch.equal(batch.image, torch.stack([e.image for e in elements]))


def test_rows_leave_what_does_not_match_the_first_element():
    memory = RecycledStack(min_bytes=1, place_bytes=1)
    with memory.rows(3) as batch_rows:
        original = torch.zeros(4)
        first = batch_rows.place(0, (original, "a"))
        wider = torch.zeros(5)
        other = batch_rows.place(1, (wider, "b"))
        graded = torch.zeros(4, requires_grad=True)
        third = batch_rows.place(2, (graded, "c"))
    assert first[0] is not original and torch.equal(first[0], original)
    assert other[0] is wider and third[0] is graded


def test_batch_row_lends_the_next_elements_row_and_placing_it_copies_nothing():
    memory = RecycledStack(min_bytes=1, place_bytes=1)
    assert batch_row((2, 4), torch.float32) is None  # no batch is being built on this thread
    with memory.rows(3) as batch_rows:
        assert batch_row((2, 4), torch.float32) is None  # the first element decides the rows
        placed = [batch_rows.place(0, (torch.zeros(2, 4), 0))]
        for j in (1, 2):
            row = batch_row((2, 4), torch.float32)
            assert (
                batch_row((2, 4), torch.float64) is None
                and batch_row((3, 4), torch.float32) is None
            )
            row.fill_(float(j))
            placed.append(batch_rows.place(j, (row, j)))
            assert placed[-1][0].data_ptr() == row.data_ptr()
        assert batch_row((2, 4), torch.float32) is None  # past the batch's end
        batch = collate_in_stage(placed, "batch", memory)
    assert batch[0].data_ptr() == placed[0][0].data_ptr()
    assert batch[0][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert batch_row((2, 4), torch.float32) is None


def test_rows_lent_for_one_tensor_and_returned_as_another_are_not_overwritten():
    memory = RecycledStack(min_bytes=1, place_bytes=1)
    with memory.rows(2) as batch_rows:
        first = batch_rows.place(0, (torch.zeros(4), torch.zeros(4)))
        a, b = batch_row((4,), torch.float32), batch_row((4,), torch.float32)
        assert a.data_ptr() != b.data_ptr()
        a.fill_(1.0)
        b.fill_(2.0)
        second = batch_rows.place(1, (b, a))  # swapped: each is the other's row
        batch = collate_in_stage([first, second], "batch", memory)
    assert batch[0][1].tolist() == [2.0] * 4 and batch[1][1].tolist() == [1.0] * 4


def big_row(i):
    return {"x": torch.full((256, 1024), float(i)), "i": i}


def test_buffers_are_not_kept_while_batches_are_made_elsewhere_even_those_lent_then():
    memory = RecycledStack(min_bytes=1)
    first, held = memory(rows(5)), memory(rows(5))
    del first
    assert memory.free_bytes == 5 * 3 * 8 * 4
    assert memory.keep_freed(False) == 5 * 3 * 8 * 4 and memory.free_bytes == 0
    del held  # lent before: it comes back, and goes
    assert memory.free_bytes == 0
    memory.keep_freed(True)
    again = memory(rows(5))
    del again
    assert memory.free_bytes == 5 * 3 * 8 * 4  # kept again


def test_batches_made_one_at_a_time_keep_one_buffer_free_a_size():
    memory = RecycledStack(min_bytes=1)
    lent = [memory(rows(5)) for _ in range(4)]
    del lent  # a trial's four in flight come back
    each = 5 * 3 * 8 * 4
    assert memory.free_bytes == 4 * each
    assert memory.keep_freed(True, most=1) == 3 * each and memory.free_bytes == each
    held, building = memory(rows(5)), memory(rows(5))
    del held, building  # the loop's batch and the next: one is kept
    assert memory.free_bytes == each


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        spans = (line.split(None, 1)[0].split("-") for line in f)
        return any(int(a, 16) <= address < int(b, 16) for a, b in spans)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_a_batch_made_on_a_thread_gives_its_pages_back_once_freed_and_not_kept():
    """A buffer from the C heap made on a pool thread stayed in that thread's arena once freed,
    which ``malloc_trim`` does not shrink: its memory is a mapping of its own, gone with it.
    (The loader's consumer keeps two batches of freed heap, as here: glibc then gives batches of
    this size from its arenas rather than mappings of their own.)"""
    hold_free(8 << 20)
    memory = RecycledStack()
    made = []
    worker = threading.Thread(target=lambda: made.append(memory(rows(4, shape=(512, 1024)))))
    worker.start()
    worker.join()
    address = made[0].data_ptr()
    assert _mapped(address)
    memory.keep_freed(False)
    made.clear()
    gc.collect()
    assert not _mapped(address)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _in_fork(probe):
    """``probe()``'s JSON-able result, run in a forked child (that never returns into pytest)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, json.dumps(probe()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        result = json.loads(f.read())
    os.waitpid(pid, 0)
    return result


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_that_forgets_the_batches_drops_their_pages_and_leaves_the_parents():
    """The zygote forgets the batches the main process made (kept at the fork, or lent and not
    yet delivered): its copies of their pages go (it never reads them), and the parent's batches
    are untouched. A batch delivered to the user stays whole there: user code may read it."""
    memory = RecycledStack(min_bytes=1)
    shape = (64, 1024)  # 16 MB a batch: pages enough to count
    kept, held = memory(rows(64, shape=shape)), memory(rows(64, shape=shape))
    given = memory(rows(64, shape=shape, start=1))
    odd = [torch.eye(3).to_sparse(), torch.zeros(2, device="meta"), torch.zeros(4)[::2]]
    delivered({"batch": [given], "names": ["a", "b"], "odd": odd})  # others are passed over
    nbytes = 2 * kept.numel() * kept.element_size()
    del kept  # one kept for reuse, one lent

    def probe():
        before = _rss_bytes()
        dropped = forget_batches_in_fork()
        gone = before - _rss_bytes()
        # numpy: torch's threads are not forked
        # the delivered batch as the child reads it: a sum of every element and a few of them
        seen = given.numpy()
        return [
            dropped,
            gone,
            int(not held.numpy()[1:-1].any()),
            float(seen.sum()),
            seen[::9, 1, :3].tolist(),
        ]

    dropped, gone, zeros, total, some = _in_fork(probe)
    assert 0.99 * nbytes <= dropped < 1.5 * nbytes and gone >= 0.9 * nbytes and zeros
    expected = torch.stack(rows(64, shape=shape, start=1))
    assert total == float(expected.sum()) > 0 and some == expected[::9, 1, :3].tolist()
    assert torch.equal(held, torch.stack(rows(64, shape=shape)))  # the parent's as made


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_batches_a_pipeline_or_dataloader_gives_are_the_users_in_a_later_fork():
    pipeline = iter(tp.from_dataset(range(64)).map(big_row).batch(8))
    loader = iter(tp.DataLoader(Mapped(), batch_size=8))
    batches = [next(pipeline)["x"], next(loader)["x"]]
    assert all(b.abs().sum() > 0 for b in batches)

    def probe():
        forget_batches_in_fork()
        return [float(b.numpy().sum()) for b in batches]

    assert _in_fork(probe) == [float(b.sum()) for b in batches]


class Mapped(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return big_row(i + 1)


def test_a_batched_map_moved_to_worker_processes_keeps_no_batch_memory_here():
    """Batches made here (threads, inline) are stacked into buffers kept for the next; once
    worker processes make them, those buffers, and those of batches still held then, go."""
    ds = tp.from_dataset(range(400)).map(big_row, tp.AUTOTUNE, executor="auto").batch(8)
    with forced_call_costs(1e-3, gil_free=1.0, moves=False):  # held where the test moves them
        it = iter(ds)
        got = [next(it)]
    stage = next(s for s in stages(it) if hasattr(s, "kept_bytes"))
    move_calls(it, "thread", 2)
    got += [next(it) for _ in range(6)]
    move_calls(it, "process", 2)
    del got  # the batches made here come back: not kept
    assert stage.kept_bytes == 0
    batches = [next(it) for _ in range(6)]
    assert stage.kept_bytes == 0
    move_calls(it, "inline", 0)
    del batches
    batches = [next(it) for _ in range(6)]  # the workers' in flight first, then made here
    del batches
    assert stage.kept_bytes > 0
    seqs = [int(b["i"][0]) for b in it]
    assert seqs == list(range(19 * 8, 400, 8))


@pytest.mark.parametrize("executor", [None, "thread"])
def test_pipelines_batch_large_elements_into_reused_memory(executor):
    ds = (
        tp.from_dataset(range(40))
        .map(
            big_row,
            num_parallel_calls=None if executor is None else 2,
            executor=executor or "thread",
        )
        .batch(8)
    )
    seen = []
    for batch in ds:
        assert torch.equal(batch["x"][:, 0, 0], batch["i"].float())
        seen.append(batch["x"].data_ptr())
        del batch
    assert len(set(seen)) < len(seen)  # a freed batch's memory held a later one


def test_a_batch_with_a_different_shape_still_says_so():
    def shaped(i):
        return torch.zeros(256, 1024 + (i == 5))

    with pytest.raises(ValueError, match="different shapes in one batch"):
        list(tp.from_dataset(range(8)).map(shaped).batch(8))
    with pytest.raises(ValueError, match="different shapes in one batch"):
        list(
            tp.from_dataset(range(8)).map(shaped, num_parallel_calls=2, executor="thread").batch(8)
        )


@pytest.mark.parametrize("min_bytes, place_bytes", [(1 << 20, 1), (1, 1 << 10)])
def test_small_elements_are_left_alone_after_the_first(min_bytes, place_bytes):
    # a small batch; small rows
    memory = RecycledStack(min_bytes=min_bytes, place_bytes=place_bytes)
    with memory.rows(64) as batch_rows:
        elements = [(torch.zeros(4), i) for i in range(3)]
        assert all(batch_rows.place(j, e) is e for j, e in enumerate(elements))


def test_batches_with_nothing_to_place_skip_the_check_but_for_every_16th():
    memory = RecycledStack(min_bytes=1, place_bytes=1 << 20)

    def batch(large):
        with memory.rows(2) as batch_rows:
            batch_rows.place(0, (torch.zeros((1 << 20) if large else 4), 0))

    batch(large=False)  # small rows: nothing to place
    asked = []
    for _ in range(2 * RECHECK_EVERY):
        asked.append(memory.placing())
        if asked[-1]:
            batch(large=False)
    # every 16th batch checks again
    assert asked.count(True) == 2 and asked[RECHECK_EVERY - 1] is True
    batch(large=True)  # ... and finding a large row there, every batch places again
    assert all(memory.placing() for _ in range(3))


def test_a_shape_asked_for_while_the_first_element_is_made_gets_rows_however_small():
    memory = RecycledStack(min_bytes=1, place_bytes=1 << 30)
    with memory.rows(3) as batch_rows:  # nothing asked: small tensors are left to the stack
        first = torch.zeros(2, 4)
        assert batch_rows.place(0, (first, 0))[0] is first
        assert batch_row((2, 4), torch.float32) is None
    with memory.rows(3) as batch_rows:
        assert batch_row((2, 4), torch.float32) is None  # asked: the first element's is a copy
        placed = [batch_rows.place(0, (first, 0))]
        assert placed[0][0] is not first and torch.equal(placed[0][0], first)
        for j in (1, 2):
            row = batch_row((2, 4), torch.float32)
            placed.append(batch_rows.place(j, (row.fill_(float(j)), j)))
        batch = collate_in_stage(placed, "batch", memory)
    assert batch[0].data_ptr() == placed[0][0].data_ptr()  # stacked in place: no copy
    assert batch[0][:, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_a_lent_row_the_element_does_not_return_is_never_written():
    memory = RecycledStack(min_bytes=1, place_bytes=1)
    kept = []  # as a function's own cache, or a shuffle buffer, would keep it
    with memory.rows(3) as batch_rows:
        placed = [batch_rows.place(0, (torch.zeros(2, 4), 0))]
        kept.append(batch_row((2, 4), torch.float32).fill_(7.0))
        placed.append(batch_rows.place(1, (torch.full((2, 4), 1.0), 1)))
        assert batch_row((2, 4), torch.float32) is None  # no more rows lent in this batch
        placed.append(batch_rows.place(2, (torch.full((2, 4), 2.0), 2)))
        batch = collate_in_stage(placed, "batch", memory)
    assert batch[0][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert kept[0].eq(7.0).all()


def test_rows_are_not_lent_where_the_batch_does_not_ask_to():
    memory = RecycledStack(min_bytes=1, place_bytes=1)
    with memory.rows(3, lend=False) as batch_rows:
        batch_rows.place(0, (torch.zeros(2, 4), 0))
        assert batch_row((2, 4), torch.float32) is None

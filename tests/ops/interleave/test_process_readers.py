"""interleave(executor="process"): inner datasets read in worker processes, tf.data's order."""

import os
import signal
import time

import pytest

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements


def inner(x):
    return tp.range(x % 5).map(lambda y: (x, y, os.getpid()))


def values(elements):
    return [(x, y) for x, y, _ in elements]


@pytest.mark.parametrize("cycle, block", [(1, 1), (2, 3), (3, 2), (8, 1)])
def test_same_order_as_inline(cycle, block):
    inline = tp.range(12).interleave(inner, cycle_length=cycle, block_length=block)
    workers = tp.range(12).interleave(
        inner, cycle_length=cycle, block_length=block, num_parallel_calls=2, executor="process"
    )
    out = list(workers)
    assert values(out) == values(inline)
    assert os.getpid() not in {pid for *_, pid in out}


def test_long_inner_datasets_arrive_in_chunks():
    ds = tp.range(3).interleave(
        lambda x: tp.range(300).map(lambda y: x * 1000 + y),
        cycle_length=3,
        block_length=7,
        num_parallel_calls=2,
        executor="process",
    )
    inline = tp.range(3).interleave(
        lambda x: tp.range(300).map(lambda y: x * 1000 + y), cycle_length=3, block_length=7
    )
    assert list(ds) == list(inline)


def test_random_inner_pipelines_match_threads_and_inline():
    def noisy(x):
        return tp.range(3).map(lambda y: (x, y, float(tp.rng().random())))

    seeded = tp.Options(seed=9)
    runs = [
        list(
            tp.range(6)
            .interleave(noisy, cycle_length=2, num_parallel_calls=2, executor=executor)
            .with_options(seeded)
        )
        for executor in ("process", "thread")
    ]
    runs.append(list(tp.range(6).interleave(noisy, cycle_length=2).with_options(seeded)))
    assert runs[0] == runs[1] == runs[2]


def test_errors_arrive_in_place_with_their_type():
    def fragile(x):
        if x == 2:
            raise KeyError("cannot open 2")
        return tp.range(3).map(lambda y: 10 // (y - 1) if x == 4 else y)

    def run(executor):
        return (
            list(
                tp.range(6)
                .interleave(fragile, cycle_length=2, num_parallel_calls=2, executor=executor)
                .ignore_errors()
            )
            if executor
            else list(tp.range(6).interleave(fragile, cycle_length=2).ignore_errors())
        )

    assert run("process") == run(None)
    with pytest.raises(KeyError, match="cannot open 2"):
        list(
            tp.range(6).interleave(
                fragile, cycle_length=2, num_parallel_calls=2, executor="process"
            )
        )


def test_checkpoint_roundtrip():
    ds = tp.range(7).interleave(
        lambda x: tp.range(x % 4),
        cycle_length=3,
        block_length=2,
        num_parallel_calls=2,
        executor="process",
    )
    assert_checkpoint_roundtrip(ds)
    inline = tp.range(7).interleave(lambda x: tp.range(x % 4), cycle_length=3, block_length=2)
    state_it = iter(inline)
    [next(state_it) for _ in range(5)]
    resumed = iter(ds)
    # the inline and process states are the same format
    resumed.load_state_dict(state_it.state_dict())
    assert_same_elements(resumed, state_it)


def test_killed_worker_loses_nothing():
    def slow(x):
        return tp.range(30).map(lambda y: (x, y, os.getpid()))

    it = iter(
        tp.range(4).interleave(
            slow, cycle_length=2, block_length=5, num_parallel_calls=2, executor="process"
        )
    )
    head = [next(it) for _ in range(12)]
    os.kill(head[-1][2], signal.SIGKILL)
    rest = list(it)
    expected = list(
        tp.range(4).interleave(
            lambda x: tp.range(30).map(lambda y: (x, y)), cycle_length=2, block_length=5
        )
    )
    assert values(head + rest) == expected


def test_a_stream_is_opened_once_per_reader(tmp_path, monkeypatch):
    """Inner datasets that can only resume by re-reading (a generator) are read once, not
    re-opened per chunk: each reader's chunks go to the worker that keeps it open."""
    from torchpipe.ops.interleave import process_readers

    monkeypatch.setattr(process_readers, "CHUNK_ITEMS", 16)  # many chunks per inner dataset
    log = tmp_path / "opens"

    def stream(x):
        def records():
            with open(log, "a") as f:
                f.write(f"{x}\n")
            yield from (x * 1000 + y for y in range(100))

        return tp.from_iterable(records)

    ds = tp.range(6).interleave(stream, cycle_length=2, num_parallel_calls=2, executor="process")
    assert list(ds) == list(tp.range(6).interleave(stream, cycle_length=2))
    opened = log.read_text().split()
    assert sorted(opened[: len(opened) - 6]) == [
        str(x) for x in range(6)
    ]  # the inline run added the rest


def test_chunks_end_early_for_slow_reads(monkeypatch):
    """A chunk ends after ``CHUNK_S`` of reading: slow records come back a few at a time."""
    import time

    from torchpipe.core.function import UserFunction
    from torchpipe.core.node import BuildContext
    from torchpipe.ops.interleave import chunk_task
    from torchpipe.ops.interleave.readers import InnerOpener

    monkeypatch.setattr(chunk_task, "CHUNK_S", 0.01)

    def slow(x):
        return tp.range(50).map(lambda y: time.sleep(0.004) or y)

    ctx = BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())
    task = chunk_task.InnerChunkTask(InnerOpener(UserFunction(slow, "interleave(slow)", ctx), ctx))
    first = task(0, (0, 0, None, 256, 0, 0, False))
    # a loaded machine may take 10 ms for one 4 ms read: ends early all the same
    assert 1 <= len(first) < 10
    second = task(1, (0, 0, first[-1][2], 256, 0, 1, False))  # the open iterator reads on
    assert [payload for _, payload, _ in first + second] == list(range(len(first) + len(second)))
    # a chunk other than the one the kept iterator reads next re-opens at the state
    reopened = task(2, (0, 0, first[-1][2], 256, 0, 1, False))
    assert reopened[0][1] == len(first)


def test_tensor_records_arrive_as_rows_and_checkpoint_mid_chunk():
    """Chunks of same-shape records travel as columns; elements and checkpoints are unchanged."""
    import torch

    def records(x):
        return tp.range(40).map(
            lambda y: {"x": torch.full((3,), float(x * 100 + y)), "label": y % 7}
        )

    ds = tp.range(5).interleave(
        records, cycle_length=2, block_length=3, num_parallel_calls=2, executor="process"
    )
    inline = tp.range(5).interleave(records, cycle_length=2, block_length=3)
    assert_same_elements(iter(ds), iter(inline))
    assert_checkpoint_roundtrip(ds, positions=[0, 7, 41, 150])


def test_chunks_end_at_about_chunk_bytes(monkeypatch):
    import torch

    from torchpipe.core.function import UserFunction
    from torchpipe.core.node import BuildContext
    from torchpipe.ops.interleave import chunk_task
    from torchpipe.ops.interleave.readers import InnerOpener

    def big(x):
        return tp.range(100).map(lambda y: torch.full((128, 1024), float(y)))  # 512 KiB each

    # only the bytes end this chunk, however slow
    monkeypatch.setattr(chunk_task, "CHUNK_S", 60.0)
    ctx = BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())
    task = chunk_task.InnerChunkTask(InnerOpener(UserFunction(big, "interleave(big)", ctx), ctx))
    chunk = task(0, (0, 0, None, 256, 0, 0, False))
    assert isinstance(chunk, chunk_task.PackedChunk)
    items = chunk.items()
    assert len(items) == chunk_task.CHUNK_BYTES // (512 << 10)
    assert [float(value[0, 0]) for _, value, _ in items] == list(range(len(items)))


def _late_first(x):
    def element(y):
        if x == 0 and y == 0:
            time.sleep(0.5)  # the first inner dataset is slow to start
        return x * 100 + y

    return tp.range(3).map(element)


def test_non_deterministic_order_passes_over_a_slot_with_nothing_read():
    kwargs = dict(cycle_length=3, num_parallel_calls=3, executor="process")
    inline = list(tp.range(6).interleave(_late_first, cycle_length=3))
    ordered = list(tp.range(6).interleave(_late_first, **kwargs))
    assert ordered == inline and ordered[0] == 0
    loose = list(tp.range(6).interleave(_late_first, deterministic=False, **kwargs))
    assert sorted(loose) == sorted(inline)
    assert loose[0] != 0  # the others were served while the first inner dataset slept

import os
import pickle
import subprocess
import sys

import pytest

import torchpipe as tp
from tests.graph.passes.toggle import (
    assert_pass_keeps_output,
    only,
    rewrites,
    run_labels,
    unoptimized,
)
from torchpipe.testing import as_torch_worker, assert_checkpoint_roundtrip


def write_files(tmp_path, count=4, per_file=(5, 9, 3, 7)):
    """TFRecord files whose record ``i`` of file ``f`` is ``f"{f}:{i}"``, of varied lengths."""
    paths = []
    for f in range(count):
        paths.append(str(tmp_path / f"part-{f}.tfrecord"))
        with tp.io.TFRecordWriter(paths[-1]) as writer:
            for i in range(per_file[f % len(per_file)]):
                writer.write(f"{f}:{i}".encode() + b"." * (i * 37))
    return paths


RECORDS = [f"{f}:{i}" for f, n in enumerate((5, 9, 3, 7)) for i in range(n)]


def name(record):
    return record.split(b".")[0].decode()


def name_and_pid(record):
    return name(record), os.getpid()


def seeds(tmp_path, **interleave):
    paths = write_files(tmp_path)
    return tp.from_iterable(paths).interleave(tp.TFRecordDataset, **interleave)


@pytest.mark.parametrize("cycle_length, block_length", [(1, 1), (2, 3), (3, 2), (8, 1)])
def test_the_same_records_in_the_same_order_and_checkpoints_resume(
    tmp_path, cycle_length, block_length
):
    ds = seeds(tmp_path, cycle_length=cycle_length, block_length=block_length, num_parallel_calls=2)
    ds = ds.map(name, num_parallel_calls=2, executor="thread")
    expected = assert_pass_keeps_output(ds, "record_pushdown")
    assert len(expected) == 24


def test_records_are_read_in_the_workers_one_task_a_batch(tmp_path):
    ds = (
        seeds(tmp_path, cycle_length=2, num_parallel_calls=2)
        .map(name_and_pid, 2, executor="process")
        .batch(5)
    )
    on = only(ds, "record_pushdown", "map_batch_fusion")
    notes = rewrites(on)
    assert "record_pushdown" in notes and "map_batch_fusion" in notes, on.explain()
    # inline: no readers
    assert "interleave(fn=tfrecord_file, cycle_length=2, block_length=1)" in run_labels(on)
    got = list(on)
    assert [n for batch in got for n in batch[0]] == [
        n for batch in unoptimized(ds) for n in batch[0]
    ]
    assert all(int(pid) != os.getpid() for batch in got for pid in batch[1])


def test_flat_map_shuffle_and_repeat_between_run_on_addresses(tmp_path):
    paths = write_files(tmp_path)
    ds = (
        tp.list_files(str(tmp_path / "*.tfrecord"))
        .flat_map(tp.TFRecordDataset)
        .shuffle(6)
        .repeat(2)
    )
    ds = ds.map(name, num_parallel_calls=2, executor="thread").with_options(tp.Options(seed=4))
    got = assert_pass_keeps_output(ds, "record_pushdown", roundtrip=False)
    assert (
        "through repeat through shuffle"
        in rewrites(only(ds, "record_pushdown"))["record_pushdown"][0]
    )
    assert sorted(got) == sorted(RECORDS * 2)
    assert len(paths) == 4


def test_states_load_across_the_pass_either_way(tmp_path):
    ds = seeds(tmp_path, cycle_length=3, block_length=2, num_parallel_calls=2).map(
        name, 2, executor="thread"
    )
    on, off = only(ds, "record_pushdown"), only(ds)
    for source, target in [(off, on), (on, off)]:
        it = iter(source)
        head = [next(it) for _ in range(10)]
        state = it.state_dict()
        rest = list(it)
        it.close()
        resumed = iter(target)
        resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
        assert head + list(resumed) == head + rest


def test_resumes_exactly_in_a_new_process(tmp_path):
    ds = (
        seeds(tmp_path, cycle_length=3, num_parallel_calls=2)
        .map(name, 2, executor="process")
        .batch(4)
    )
    it = iter(ds)
    [next(it) for _ in range(2)]
    state = it.state_dict()
    rest = list(it)
    (tmp_path / "state.pkl").write_bytes(pickle.dumps(state))
    script = (
        "import pickle, sys, torchpipe as tp\n"
        "from tests.graph.passes.test_record_pushdown import name\n"
        f"paths = sorted(str(p) for p in __import__('pathlib').Path({str(tmp_path)!r}).glob('*.tfrecord'))\n"
        "ds = tp.from_iterable(paths).interleave(tp.TFRecordDataset, cycle_length=3, num_parallel_calls=2)\n"
        "it = iter(ds.map(name, 2, executor='process').batch(4))\n"
        f"it.load_state_dict(pickle.load(open({str(tmp_path / 'state.pkl')!r}, 'rb')))\n"
        "print(repr([b for b in it]))\n"
    )
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(rest)


def test_every_record_once_across_ranks_and_torch_workers(tmp_path):
    paths = write_files(tmp_path, count=12, per_file=(2,))
    got = []
    for rank in range(2):
        for worker in range(3):
            ds = tp.TFRecordDataset(paths, num_parallel_reads=2).map(name, 2, executor="thread")
            options = tp.DistributeOptions(rank=rank, world_size=2, uneven="allow")
            ds = ds.with_options(tp.Options(seed=7, distribute=options))
            assert "record_pushdown" in rewrites(ds)
            with as_torch_worker(worker, 3):
                got.extend(ds)
    assert sorted(got) == sorted(f"{f}:{i}" for f in range(12) for i in range(2))


def test_every_record_once_in_each_epoch(tmp_path):
    ds = (
        seeds(tmp_path, cycle_length=2, num_parallel_calls=2)
        .map(name, 2, executor="thread")
        .batch(5)
    )
    epochs = [[n for batch in ds for n in batch] for _ in range(2)]
    assert [sorted(e) for e in epochs] == [sorted(RECORDS)] * 2


def test_not_for_compressed_remote_or_unknown_files(tmp_path):
    paths = write_files(tmp_path)
    gzip = tp.from_iterable(paths).interleave(
        lambda p: tp.TFRecordDataset(p, "GZIP"), cycle_length=2
    )
    compressed = tp.TFRecordDataset(paths, compression_type="GZIP", num_parallel_reads=2).map(
        name, 2
    )
    remote = (
        tp.from_iterable(["s3://bucket/a.tfrecord"])
        .interleave(tp.TFRecordDataset, cycle_length=2)
        .map(name, 2)
    )
    made = (
        tp.range(4)
        .map(lambda i: paths[i])
        .interleave(tp.TFRecordDataset, cycle_length=2)
        .map(name, 2)
    )
    no_map = tp.TFRecordDataset(paths, num_parallel_reads=2).batch(2)
    for ds in (gzip.map(name, 2), compressed, remote, made, no_map):
        assert "record_pushdown" not in rewrites(ds), ds.explain()


def test_the_pass_can_be_switched_off(tmp_path):
    ds = seeds(tmp_path, cycle_length=2, num_parallel_calls=2).map(name, 2)
    off = ds.with_options(tp.Options(optimizations={"record_pushdown": False}))
    assert "record_pushdown" in rewrites(ds) and "record_pushdown" not in rewrites(off)
    assert list(off) == list(ds)


def test_roundtrip_through_the_fused_batch(tmp_path):
    ds = (
        seeds(tmp_path, cycle_length=3, block_length=2, num_parallel_calls=2)
        .map(name, 2, executor="thread")
        .batch(3)
    )
    assert_checkpoint_roundtrip(ds)

"""TFRecord files read by record address (the optimizer's record_pushdown): a batch's records in a
few reads, damaged records failing alone with their file and offset, checkpoints that hold a
reader's position, and the files' indexes kept between epochs."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

import torchpipe as tp
from tests.io.test_index import write
from torchpipe.io import addresses as by_address
from torchpipe.io import index as tfrecord_index
from torchpipe.io.addresses import RecordAddress, RecordFetch
from torchpipe.io.index import TFRecordAddressFormat
from torchpipe.io.webdataset import TarAddressFormat
from torchpipe.testing import as_torch_worker, assert_checkpoint_roundtrip


@pytest.fixture
def files(tmp_path):
    records = [[b"%d:%d|" % (k, i) + b"x" * (i * 11) for i in range(6)] for k in range(3)]
    return [write(tmp_path / f"f{k}.tfrecord", records[k]) for k in range(3)]


def label(record):
    return record.split(b"|")[0].decode()


def pipeline(paths, *, after_map=None, **options):
    ds = tp.from_iterable(paths).interleave(
        tp.TFRecordDataset, cycle_length=3, num_parallel_calls=2
    )
    ds = ds.map(label, num_parallel_calls=2, executor="thread")
    ds = after_map(ds) if after_map is not None else ds
    return ds.with_options(tp.Options(**options)) if options else ds


def off(ds):
    return ds.with_options(tp.Options(optimizations={"record_pushdown": False}))


def addresses(path):
    index = tp.io.tfrecord_index(path, write=False)
    return [RecordAddress(path, int(offset), int(length)) for offset, length in index.tolist()]


def test_a_batch_of_adjacent_records_is_one_read_a_file(files, monkeypatch):
    fetch = RecordFetch(TFRecordAddressFormat(verify=True))
    wanted = [
        addresses(files[0])[1],
        addresses(files[1])[0],
        addresses(files[0])[2],
        addresses(files[1])[1],
    ]
    reads = []
    real = os.pread
    monkeypatch.setattr(
        by_address.os, "pread", lambda fd, n, at: reads.append(n) or real(fd, n, at)
    )
    assert [label(r) for r in fetch.__getitems__(wanted)] == ["0:1", "1:0", "0:2", "1:1"]
    assert len(reads) == 2  # one run in each file, whatever the order asked
    assert label(fetch[addresses(files[2])[5]]) == "2:5"


def test_a_damaged_record_fails_alone_naming_its_file_and_offset(files):
    target = addresses(files[1])[2]
    with open(files[1], "r+b") as f:  # a byte of its data: its CRC no longer matches
        f.seek(target.offset + 14)
        f.write(b"#")
    with pytest.raises(
        tp.io.DataLossError, match=f"{files[1]}: corrupt record at byte {target.offset}"
    ) as caught:
        list(pipeline(files))
    assert caught.value.path == files[1] and caught.value.offset == target.offset
    kept = list(pipeline(files, after_map=lambda ds: ds.ignore_errors()))
    expected = sorted(f"{k}:{i}" for k in range(3) for i in range(6) if (k, i) != (1, 2))
    # the records after it in its file too: only the damaged one is lost
    assert sorted(kept) == expected


def test_a_damaged_header_ends_its_file_there_as_a_reader_does(files):
    target = addresses(files[0])[3]
    with open(files[0], "r+b") as f:  # its length: the records after it cannot be framed
        f.seek(target.offset)
        f.write(b"\xff")
    by_address.INDEXES.clear()
    on = list(pipeline(files, after_map=lambda ds: ds.ignore_errors()))
    assert on == list(off(pipeline(files, after_map=lambda ds: ds.ignore_errors())))
    assert sorted(x for x in on if x.startswith("0:")) == ["0:0", "0:1", "0:2"]
    with pytest.raises(tp.io.DataLossError, match=f"corrupt record at byte {target.offset}"):
        list(pipeline(files))


def test_a_file_changed_since_the_checkpoint_is_named(files):
    it = iter(pipeline(files))
    [next(it) for _ in range(4)]
    state = it.state_dict()
    it.close()
    # new lengths: the saved offsets fall inside records
    write(files[0], [b"other|" + b"y" * 3] * 6)
    resumed = iter(pipeline(files))
    resumed.load_state_dict(state)
    with pytest.raises(tp.CheckpointError, match="no record of .*f0.tfrecord starts at byte"):
        list(resumed)


def test_a_sidecar_is_read_where_there_is_one_and_none_is_written(files, monkeypatch):
    by_address.INDEXES.clear()
    assert list(pipeline(files)) == list(off(pipeline(files)))
    # the data's directory is left alone
    assert not any(os.path.exists(path + ".idx") for path in files)
    tp.io.tfrecord_index(files[0])  # the user's own
    by_address.INDEXES.clear()
    monkeypatch.setattr(
        tfrecord_index, "scan_until_error", lambda *a: pytest.fail("scanned a file with a sidecar")
    )
    assert [
        label(r) for r in RecordFetch(TFRecordAddressFormat(True)).__getitems__(addresses(files[0]))
    ] == [f"0:{i}" for i in range(6)]
    assert by_address.INDEXES.get(TFRecordAddressFormat(True), files[0]).offsets == [
        a.offset for a in addresses(files[0])
    ]


def test_indexes_are_kept_between_epochs(files, monkeypatch):
    by_address.INDEXES.clear()
    built = []
    real = tfrecord_index.index_until_error
    monkeypatch.setattr(
        tfrecord_index, "index_until_error", lambda path: built.append(path) or real(path)
    )
    ds = pipeline(files)
    first, second = list(ds), list(ds)
    assert first == second and sorted(built) == sorted(files)


def test_file_urls_are_local_files(files):
    urls = [f"file://{path}" for path in files]
    ds = pipeline(urls)
    assert "record_pushdown" in ds.explain(as_dict=True)["rewrites"]
    assert list(ds) == list(off(pipeline(files)))


# -- WebDataset tar shards ---------------------------------------------------------------------------
def write_shard(path, samples, extra=()):
    """A tar shard of ``samples`` (key -> {ext: bytes}), with ``extra`` members (name, bytes or None
    for a directory) written first: what a reader skips."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in extra:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture
def shards(tmp_path):
    paths = []
    for f in range(3):
        samples = [
            (f"dir/s{f}-{i}", {"cls": b"%d" % (f * 100 + i), "Txt": b"y" * (i * 700)})
            for i in range(4 + f)
        ]
        extra = (
            [("dir", None), ("__meta__/info.json", b"{}"), ("README", b"no dot")] if f == 1 else ()
        )
        paths.append(write_shard(tmp_path / f"shard-{f}.tar", samples, extra))
    return paths


def sample_summary(sample):
    return (
        sample["__key__"],
        int(sample["cls"]),
        len(sample["txt"]),
        os.path.basename(sample["__url__"]),
    )


def shard_pipeline(paths, *, after_map=None, **webdataset):
    ds = tp.from_webdataset(paths, num_parallel_reads=2, **webdataset).map(
        sample_summary, 2, executor="thread"
    )
    return after_map(ds) if after_map is not None else ds


def test_tar_samples_come_as_their_reader_gives_them_and_resume(shards):
    ds = shard_pipeline(shards, shardshuffle=True, seed=3)
    assert "record_pushdown" in ds.explain(as_dict=True)["rewrites"]
    got = list(ds)
    assert got == list(off(ds)) and len(got) == 4 + 5 + 6
    assert_checkpoint_roundtrip(ds, positions=[0, 3, 7, 14])


def test_a_damaged_shard_ends_where_its_reader_ends(shards):
    with open(shards[1], "r+b") as f:  # cut inside the fourth sample: its reader fails there
        f.truncate(
            by_address.INDEXES.get(TarAddressFormat(), shards[1]).offsets[3] + 1700
        )  # in its txt data
    by_address.INDEXES.clear()
    kept = shard_pipeline(shards, after_map=lambda ds: ds.ignore_errors())
    assert list(kept) == list(off(kept))
    assert sorted(key for key, *_ in kept if key.startswith("dir/s1")) == [
        "dir/s1-0",
        "dir/s1-1",
        "dir/s1-2",
    ]
    with pytest.raises(tp.io.DataLossError, match=f"{shards[1]}: damaged tar shard at byte"):
        list(shard_pipeline(shards))


def test_compressed_shards_keep_their_readers(tmp_path):
    path = tmp_path / "shard-0.tar.gz"
    with tp.io.TarWriter(str(path)) as writer:
        writer.write({"__key__": "a", "cls": 1})
    ds = tp.from_webdataset(str(path), num_parallel_reads=2).map(sample_summary, 2)
    assert "record_pushdown" not in ds.explain(as_dict=True)["rewrites"]


def test_every_sample_once_across_ranks_and_torch_workers(shards):
    got = []
    for rank in range(2):
        for worker in range(2):
            options = tp.DistributeOptions(rank=rank, world_size=2, uneven="allow")
            ds = shard_pipeline(shards).with_options(tp.Options(seed=5, distribute=options))
            with as_torch_worker(worker, 2):
                assert "record_pushdown" in ds.explain(as_dict=True)["rewrites"]
                got.extend(key for key, *_ in ds)
    assert sorted(got) == sorted(f"dir/s{f}-{i}" for f in range(3) for i in range(4 + f))

"""Record indexes and TFRecordRecords: random access, sidecars, global shuffle without a record
buffer, source pushdown into workers, and index-only checkpoints."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

import torchpipe as tp
from tests.graph.passes.toggle import run_labels
from torchpipe.testing import assert_checkpoint_roundtrip

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tensorflow")


def write(path, records) -> str:
    with tp.io.TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    return str(path)


@pytest.fixture
def shards(tmp_path):
    return [
        write(tmp_path / f"s{k}.tfrecord", [b"%d:%d" % (k, i) * (i + 1) for i in range(5 + k)])
        for k in range(3)
    ]


def test_index_lists_offsets_and_lengths_and_saves_a_sidecar(tmp_path):
    path = write(tmp_path / "f.tfrecord", [b"a", b"", b"xyz"])
    index = tp.io.tfrecord_index(path)
    assert index.tolist() == [[0, 17], [17, 16], [33, 19]] and index.dtype == np.int64
    # DALI's / the tfrecord package's format
    assert open(path + ".idx").read() == "0 17\n17 16\n33 19\n"
    assert tp.io.tfrecord_index(path, write=False).tolist() == index.tolist()


def test_sidecar_is_read_and_a_stale_one_rebuilt(tmp_path, monkeypatch):
    path = write(tmp_path / "f.tfrecord", [b"a", b"bb"])
    tp.io.tfrecord_index(path)
    import torchpipe.io.index as index_module

    def no_scan(*args):
        raise AssertionError("scanned although the sidecar fits")

    monkeypatch.setattr(index_module, "scan_records", no_scan)
    assert tp.io.tfrecord_index(path).tolist() == [[0, 17], [17, 18]]
    monkeypatch.undo()
    write(path, [b"a", b"bb", b"ccc"])  # the file grew: the sidecar no longer fits
    assert tp.io.tfrecord_index(path).tolist() == [[0, 17], [17, 18], [35, 19]]
    open(path + ".idx", "w").write("garbage\n")
    assert len(tp.io.tfrecord_index(path)) == 3


def test_index_of_a_corrupt_or_truncated_file_names_the_offset(tmp_path):
    path = write(tmp_path / "f.tfrecord", [b"a" * 10, b"b" * 10, b"c" * 10])
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(data[:-5]))
    with pytest.raises(tp.io.DataLossError, match="truncated record at byte 52"):
        tp.io.tfrecord_index(path, write=False)
    data[26 + 2] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(tp.io.DataLossError, match="corrupt record at byte 26"):
        tp.io.tfrecord_index(path, write=False)


def test_tensorflow_fixture_indexes(tmp_path):
    records = tp.io.TFRecordRecords(os.path.join(FIXTURES, "records.tfrecord"), write_index=False)
    assert [records[i] for i in range(len(records))] == list(
        tp.TFRecordDataset(os.path.join(FIXTURES, "records.tfrecord"))
    )


def test_records_are_random_access_across_files(shards):
    records = tp.io.TFRecordRecords(shards)
    everything = list(tp.TFRecordDataset(shards))
    assert len(records) == len(everything) == 5 + 6 + 7
    assert [records[i] for i in range(len(records))] == everything
    assert records[-1] == everything[-1] and records[7] == everything[7]
    with pytest.raises(IndexError, match="out of range"):
        records[len(records)]
    clone = pickle.loads(pickle.dumps(records))
    assert clone[12] == everything[12]


def test_a_record_damaged_after_indexing_is_caught(shards):
    records = tp.io.TFRecordRecords(shards)
    with open(shards[1], "r+b") as f:
        f.seek(12 + 1)
        f.write(b"\x00")
    with pytest.raises(
        tp.io.DataLossError, match=f"{shards[1]}: corrupt record at byte 0: the data's CRC"
    ):
        records[5]
    assert tp.io.TFRecordRecords(shards, verify=False)[5] != records[6]


def test_global_shuffle_pushdown_and_index_checkpoints(shards):
    records = tp.io.TFRecordRecords(shards)
    everything = sorted(tp.TFRecordDataset(shards))
    shuffled = tp.from_dataset(records).shuffle(len(records), seed=3)
    order = list(shuffled)
    assert sorted(order) == everything and order != list(tp.TFRecordDataset(shards))
    assert_checkpoint_roundtrip(shuffled, positions=[0, 5, 17])
    state = _state_after(tp.from_dataset(records), 4)
    assert state["pipeline"] == {"index": 4}  # a checkpoint is an index
    mapped = tp.from_dataset(records).map(len, num_parallel_calls=2, executor="process")
    assert any("[source pushed down]" in label for label in run_labels(mapped))
    assert list(mapped) == [len(r) for r in tp.TFRecordDataset(shards)]


def _state_after(ds, k):
    it = iter(ds)
    for _ in range(k):
        next(it)
    state = it.state_dict()
    it.close()
    return state


def test_bad_arguments(shards, tmp_path):
    with pytest.raises(ValueError, match="no paths"):
        tp.io.TFRecordRecords([])
    with pytest.raises(ValueError, match="1 index_paths for 3 paths"):
        tp.io.TFRecordRecords(shards, index_paths=["x"])
    with pytest.raises(TypeError):
        tp.io.TFRecordRecords([3])
    with pytest.raises(FileNotFoundError):
        tp.io.TFRecordRecords(str(tmp_path / "missing.tfrecord"))


@pytest.mark.parametrize("lengths", [[2**63 - 1, None], [-5, None], [8, None]])
def test_a_sidecar_with_impossible_lengths_is_not_used(tmp_path, lengths):
    """Lengths that wrap around to the file's size (or are negative, or shorter than their
    framing) would have a read allocate them: the file's own headers are scanned instead."""
    path = write(tmp_path / "r.tfrecord", [b"a" * 10, b"b" * 20])
    size = os.path.getsize(path)
    first = lengths[0]
    with open(path + ".idx", "w") as f:
        f.write(f"0 {first}\n{first} {size - first}\n")
    records = tp.io.TFRecordRecords(path, write_index=False)
    assert [records[0], records[1]] == [b"a" * 10, b"b" * 20]
    assert tp.io.tfrecord_index(path, write=False).tolist() == [[0, 26], [26, 36]]

"""TFRecord files: TensorFlow's fixtures read exactly and written byte for byte, checkpoints that
seek, and corrupt or truncated input named by file and offset."""

from __future__ import annotations

import os
import shutil

import pytest

import torchpipe as tp
from tests.disk_limits import no_room, payload  # noqa: F401 - no_room is a fixture
from tests.fixtures import fixture_data as fd
from torchpipe.errors import CheckpointError
from torchpipe.io.tfrecord import masked_crc
from torchpipe.testing import assert_checkpoint_roundtrip

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tensorflow")
TF_FILES = [  # name, compression, records, flush after
    ("records.tfrecord", None, fd.small_records, None),
    ("records.tfrecord.gz", "GZIP", fd.small_records, None),
    ("records.tfrecord.zz", "ZLIB", fd.small_records, None),
    ("big.tfrecord.gz", "GZIP", fd.big_records, fd.FLUSH_AFTER),
    ("big.tfrecord.zz", "ZLIB", fd.big_records, None),
]


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def write(path, records, compression=None) -> str:
    with tp.io.TFRecordWriter(path, compression) as writer:
        for record in records:
            writer.write(record)
    return str(path)


@pytest.mark.parametrize("name, compression, records, flush", TF_FILES)
def test_reads_tensorflow_files_exactly(name, compression, records, flush):
    assert list(tp.TFRecordDataset(fixture(name), compression)) == records()


@pytest.mark.parametrize("name, compression, records, flush", TF_FILES)
def test_writes_byte_identical_files(tmp_path, name, compression, records, flush):
    out = tmp_path / name
    with tp.io.TFRecordWriter(out, compression) as writer:
        for i, record in enumerate(records()):
            writer.write(record)
            if flush is not None and i + 1 == flush:
                writer.flush()
    assert out.read_bytes() == open(fixture(name), "rb").read()


def test_masked_crc_known_values():
    # CRC32C("123456789") is the standard check value 0xE3069283; masking rotates and adds.
    crc = 0xE3069283
    assert masked_crc(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert masked_crc(b"") == 0xA282EAD8


def test_round_trip_and_empty_file(tmp_path):
    records = [b"x" * n for n in (0, 1, 1000, 300_000)]
    for compression in (None, "", "GZIP", "ZLIB"):
        path = write(tmp_path / f"f{compression}", records, compression)
        assert list(tp.TFRecordDataset(path, compression_type=compression)) == records
    empty = write(tmp_path / "empty", [])
    assert os.path.getsize(empty) == 0 and list(tp.TFRecordDataset(empty)) == []
    assert list(tp.TFRecordDataset(write(tmp_path / "empty.gz", [], "GZIP"), "GZIP")) == []


def test_writer_accepts_buffers_and_rejects_misuse(tmp_path):
    path = tmp_path / "w.tfrecord"
    writer = tp.io.TFRecordWriter(path)
    writer.write(bytearray(b"ab"))
    writer.write(memoryview(b"cd"))
    with pytest.raises(TypeError, match="expected bytes, got str"):
        writer.write("text")
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="is closed"):
        writer.write(b"late")
    assert list(tp.TFRecordDataset(str(path))) == [b"ab", b"cd"]
    with pytest.raises(ValueError, match="compression_type"):
        tp.io.TFRecordWriter(path, "BZIP2")


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(filenames=5), TypeError),
        (dict(compression_type="gzip"), ValueError),
        (dict(num_parallel_reads=0), ValueError),
        (dict(buffer_size=0), ValueError),
        (dict(verify="yes"), TypeError),
        (dict(filenames=[]), ValueError),
        (dict(retry=3), TypeError),
    ],
)
def test_bad_arguments_fail_at_construction(bad, error):
    kwargs = {"filenames": fixture("records.tfrecord"), **bad}
    with pytest.raises(error):
        tp.TFRecordDataset(**kwargs)


def test_several_files_in_order_and_interleaved(tmp_path):
    paths = [
        write(tmp_path / f"{k}.tfrecord", [b"%d-%d" % (k, i) for i in range(k + 1)])
        for k in range(3)
    ]
    assert list(tp.TFRecordDataset(paths)) == [b"0-0", b"1-0", b"1-1", b"2-0", b"2-1", b"2-2"]
    interleaved = [b"0-0", b"1-0", b"2-0", b"1-1", b"2-1", b"2-2"]
    assert list(tp.TFRecordDataset(paths, num_parallel_reads=3)) == interleaved
    assert (
        list(tp.TFRecordDataset(tp.from_tensor_slices(paths), num_parallel_reads=tp.AUTOTUNE))
        == interleaved
    )
    assert list(tp.TFRecordDataset([p.encode() for p in paths][:1])) == [b"0-0"]


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_checkpoints_resume_at_every_record(tmp_path, compression):
    paths = [
        write(tmp_path / f"{k}", [b"r%d-%d" % (k, i) for i in range(4)], compression)
        for k in range(3)
    ]
    assert_checkpoint_roundtrip(tp.TFRecordDataset(paths[0], compression))
    assert_checkpoint_roundtrip(tp.TFRecordDataset(paths, compression))
    assert_checkpoint_roundtrip(tp.TFRecordDataset(paths, compression, num_parallel_reads=2))


def test_checkpoint_holds_file_and_offset_and_resume_seeks(tmp_path):
    records = [b"a" * 10, b"b" * 20, b"c" * 30, b"d" * 40]
    path = write(tmp_path / "f.tfrecord", records)
    it = iter(tp.TFRecordDataset(path))
    next(it), next(it)
    state = it.state_dict()
    it.close()
    assert state["pipeline"] == {"file": path, "offset": (16 + 10) + (16 + 20), "done": False}
    with open(path, "r+b") as f:  # damage the records before the checkpoint: a seek never sees them
        f.write(b"\xff" * (16 + 10 + 16 + 20))
    resumed = iter(tp.TFRecordDataset(path))
    resumed.load_state_dict(state)
    assert list(resumed) == records[2:]


def test_checkpoint_of_another_file_is_rejected(tmp_path):
    a, b = write(tmp_path / "a", [b"1", b"2"]), write(tmp_path / "b", [b"1", b"2"])
    it = iter(tp.TFRecordDataset(a))
    next(it)
    state = it.state_dict()
    with pytest.raises(CheckpointError, match="other parameters: op 0 was tfrecord_file"):
        iter(tp.TFRecordDataset(b)).load_state_dict(state)
    # Inside a flat_map the reader checks its file itself: the pipeline's ops are the same.
    it = iter(tp.TFRecordDataset([a]))
    next(it)
    state = it.state_dict()
    state["pipeline"]["slots"][0]["inner"]["file"] = b
    with pytest.raises(CheckpointError, match="checkpoint is of file"):
        next(iter_loaded(tp.TFRecordDataset([a]), state))


def iter_loaded(ds, state):
    it = iter(ds)
    it.load_state_dict(state)
    return it


# -- corrupt and truncated input ---------------------------------------------------------------
RECORDS = [b"first record", b"second record", b"third record", b"fourth record"]
THIRD = sum(16 + len(r) for r in RECORDS[:2])  # byte offset of the third record


def damaged(tmp_path, name, at, value=None, cut=False):
    path = write(tmp_path / name, RECORDS)
    data = bytearray(open(path, "rb").read())
    if cut:
        data = data[:at]
    else:
        data[at] ^= 0xFF if value is None else value
    open(path, "wb").write(bytes(data))
    return path


@pytest.mark.parametrize(
    "name, at, cut, message",
    [
        ("data", THIRD + 12 + 3, False, "corrupt record at byte {}: the data's CRC does not match"),
        ("length", THIRD + 1, False, "corrupt record at byte {}: the length's CRC does not match"),
        ("crc", THIRD + 12 + len(RECORDS[2]), False, "corrupt record at byte {}: the data's CRC"),
        ("cut-header", THIRD + 5, True, "truncated record at byte {}: 5 of its 12 header bytes"),
        ("cut-data", THIRD + 12 + 4, True, "truncated record at byte {}"),
    ],
)
def test_corrupt_and_truncated_records_name_file_and_offset(tmp_path, name, at, cut, message):
    path = damaged(tmp_path, name, at, cut=cut)
    it = iter(tp.TFRecordDataset(path))
    assert [next(it), next(it)] == RECORDS[:2]
    with pytest.raises(tp.io.DataLossError, match=message.format(THIRD)) as info:
        next(it)
    assert info.value.path == path and info.value.offset == THIRD and path in str(info.value)
    assert list(it) == []  # the rest of a damaged file is not read


def test_without_verification_a_bad_crc_goes_unnoticed(tmp_path):
    path = damaged(tmp_path, "data", THIRD + 12 + 3)
    got = list(tp.TFRecordDataset(path, verify=False))
    assert len(got) == 4 and got[2] != RECORDS[2] and got[3] == RECORDS[3]
    # A length past the end of the file is truncation, not an allocation of that many bytes.
    huge = damaged(tmp_path, "len", THIRD + 7, value=0x7F)
    with pytest.raises(tp.io.DataLossError, match="truncated record at byte"):
        list(tp.TFRecordDataset(huge, verify=False))


def test_ignore_errors_skips_the_bad_record_counts_it_and_goes_on_at_the_next_file(tmp_path):
    good = write(tmp_path / "good", [b"g1", b"g2"])
    bad = damaged(tmp_path, "bad", THIRD + 12 + 3)
    for reads in (None, 2):
        it = iter(tp.TFRecordDataset([good, bad, good], num_parallel_reads=reads).ignore_errors())
        got = list(it)
        expected = [b"g1", b"g2", *RECORDS[:2], b"g1", b"g2"]
        assert sorted(got) == sorted(expected) and (reads or got == expected)
        assert {s["stage"]: s for s in it.stats()}["ignore_errors"]["errors_ignored"] == 1


def test_checkpoint_after_a_skipped_record_resumes_at_the_next_file(tmp_path):
    bad = damaged(tmp_path, "bad", THIRD + 12 + 3)
    good = write(tmp_path / "good", [b"g1", b"g2"])
    assert_checkpoint_roundtrip(tp.TFRecordDataset([bad, good]).ignore_errors())


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_damaged_compressed_streams(tmp_path, compression):
    path = write(tmp_path / "c", [os.urandom(5000) for _ in range(6)], compression)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(tp.io.DataLossError, match=f"{path}: .*(truncated|stream)") as info:
        list(tp.TFRecordDataset(path, compression))
    assert info.value.path == path
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x55
    open(path, "wb").write(bytes(flipped))
    with pytest.raises(tp.io.DataLossError, match=path):
        list(tp.TFRecordDataset(path, compression))


def test_concatenated_gzip_members_read_as_one_stream(tmp_path):
    a, b = write(tmp_path / "a", [b"1", b"2"], "GZIP"), write(tmp_path / "b", [b"3"], "GZIP")
    both = tmp_path / "both"
    both.write_bytes(open(a, "rb").read() + open(b, "rb").read())
    assert list(tp.TFRecordDataset(str(both), "GZIP")) == [b"1", b"2", b"3"]


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(tp.TFRecordDataset(str(tmp_path / "nope.tfrecord")))


def test_list_files_then_interleave_reads_tensorflow_shards(tmp_path):
    for name in os.listdir(FIXTURES):
        if name.startswith("train-"):
            shutil.copy(fixture(name), tmp_path / name)
    files = tp.list_files(str(tmp_path / "train-*.tfrecord"))
    records = list(
        files.interleave(tp.TFRecordDataset, cycle_length=3, num_parallel_calls=tp.AUTOTUNE)
    )
    assert len(records) == fd.SHARDS * fd.SHARD_RECORDS and len(set(records)) == len(records)


def test_a_full_disk_fails_naming_the_file_and_leaves_the_file_there_before_unchanged(no_room):
    path = os.path.join(no_room.directory, "a.tfrecord")
    write(path, [b"before"])
    no_room.check(no_room.run(write, path, map(payload, range(8))), f"TFRecordWriter({path})")
    assert no_room.files() == ["a.tfrecord"] and list(tp.TFRecordDataset(path)) == [b"before"]
    no_room.grow()
    write(path, map(payload, range(8)))
    assert list(tp.TFRecordDataset(path)) == [payload(i) for i in range(8)]


def test_the_file_is_published_when_the_writer_closes_and_never_when_its_block_raises(tmp_path):
    path = tmp_path / "a.tfrecord"
    writer = tp.io.TFRecordWriter(path)
    writer.write(b"x")
    writer.flush()
    assert [name.startswith("a.tfrecord.tmp-") for name in os.listdir(tmp_path)] == [True]
    writer.close()
    assert os.listdir(tmp_path) == ["a.tfrecord"] and list(tp.TFRecordDataset(str(path))) == [b"x"]
    with pytest.raises(RuntimeError, match="stop"), tp.io.TFRecordWriter(path) as writer:
        writer.write(b"y")
        raise RuntimeError("stop")
    unclosed = tp.io.TFRecordWriter(path)
    unclosed.write(b"z")
    del unclosed
    assert os.listdir(tmp_path) == ["a.tfrecord"] and list(tp.TFRecordDataset(str(path))) == [b"x"]


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_record_longer_than_the_maximum_is_data_loss_not_memory(tmp_path, compression):
    import zlib

    from torchpipe.io.tfrecord_framing import MAX_RECORD_BYTES, frame_header

    path = str(tmp_path / "huge.tfrecord")
    raw = frame_header(2**62) + b"x" * 100  # a valid CRC over a length no stream holds
    packer = zlib.compressobj(6, zlib.DEFLATED, 31 if compression == "GZIP" else 15)
    with open(path, "wb") as f:
        f.write(packer.compress(raw) + packer.flush())
    with pytest.raises(
        tp.io.DataLossError, match=f"above the {MAX_RECORD_BYTES}-byte maximum"
    ) as error:
        list(tp.TFRecordDataset(path, compression_type=compression))
    assert error.value.path == path and error.value.offset == 0
    assert list(tp.TFRecordDataset(path, compression_type=compression).ignore_errors()) == []


def test_a_compressed_record_length_the_stream_lacks_is_truncation(tmp_path):
    import gzip

    from torchpipe.io.tfrecord_framing import frame_header

    path = str(tmp_path / "short.tfrecord.gz")
    with gzip.open(path, "wb") as f:
        # under the maximum: read in pieces, not allocated
        f.write(frame_header(1 << 30) + b"x" * 100)
    with pytest.raises(tp.io.DataLossError, match="truncated record at byte 0"):
        list(tp.TFRecordDataset(path, compression_type="GZIP"))

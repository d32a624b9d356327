"""io/files.py: checked paths and compressions, compressed streams, output files, shard lists."""

import gzip
import io
import os
import zlib

import pytest

import torchpipe as tp
from torchpipe.errors import CheckpointError, DataLossError
from torchpipe.io.files import (
    FileReaderIterator,
    InflateStream,
    OutputFile,
    check_compression_type,
    check_path,
    open_stream,
    path_dataset,
)

DATA = bytes(range(256)) * 64


def test_brace_expansion():
    assert tp.io.expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert tp.io.expand_braces("{a,b}/{8..10}") == ["a/8", "a/9", "a/10", "b/8", "b/9", "b/10"]
    assert tp.io.expand_braces("plain.tar") == ["plain.tar"]
    with pytest.raises(ValueError, match="counts down"):
        tp.io.expand_braces("{3..1}")


def test_a_negative_brace_range_keeps_its_width():
    assert tp.io.expand_braces("{-02..01}") == ["-02", "-01", "00", "01"]


def test_compressions_and_paths_are_checked_and_made_canonical(tmp_path):
    assert [check_compression_type("op", c) for c in (None, "", "GZIP", "ZLIB")] == [
        None,
        None,
        "GZIP",
        "ZLIB",
    ]
    with pytest.raises(ValueError, match="op: compression_type must be"):
        check_compression_type("op", "gzip")
    assert check_path("op", tmp_path) == str(tmp_path) and check_path("op", b"a/b") == "a/b"
    with pytest.raises(TypeError, match="op: a path must be a str, bytes or os.PathLike, got int"):
        check_path("op", 3)


def _compressed(data, compression):
    packer = zlib.compressobj(6, zlib.DEFLATED, 31 if compression == "GZIP" else 15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_a_stream_opens_at_an_offset_of_its_uncompressed_bytes(tmp_path, compression):
    path = tmp_path / "data"
    path.write_bytes(DATA if compression is None else _compressed(DATA, compression))
    with open_stream(str(path), compression, 1024, offset=1000) as stream:
        assert stream.read() == DATA[1000:]
    if compression is not None:  # a compressed stream is read up to its offset: it must be there
        with pytest.raises(DataLossError, match=f"the {compression} stream ends at byte 16384"):
            open_stream(str(path), compression, 1024, offset=len(DATA) + 1)


def test_gzip_members_are_read_one_after_another_and_zlib_ends_with_its_stream():
    members = gzip.compress(b"first ") + gzip.compress(b"second")
    assert io.BufferedReader(InflateStream(io.BytesIO(members), "GZIP", "f")).read() == (
        b"first second"
    )
    twice = _compressed(b"one", "ZLIB") + _compressed(b"two", "ZLIB")
    assert io.BufferedReader(InflateStream(io.BytesIO(twice), "ZLIB", "f")).read() == b"one"


def test_truncated_or_corrupt_compressed_bytes_name_the_file_and_offset():
    packed = _compressed(DATA, "GZIP")
    with pytest.raises(DataLossError, match="f.gz: the GZIP stream is truncated at compressed"):
        io.BufferedReader(InflateStream(io.BytesIO(packed[:-20]), "GZIP", "f.gz")).read()
    broken = packed[:10] + bytes(len(packed) - 10)
    with pytest.raises(DataLossError, match="f.gz: corrupt GZIP data near compressed byte") as e:
        io.BufferedReader(InflateStream(io.BytesIO(broken), "GZIP", "f.gz")).read()
    assert e.value.__cause__ is not None


def test_an_output_file_appears_only_when_published(tmp_path):
    path = tmp_path / "out.bin"
    out = OutputFile(str(path), "Writer(out.bin)")
    out.write(b"abc")
    out.flush()
    assert not path.exists()
    out.publish()
    assert path.read_bytes() == b"abc" and os.listdir(tmp_path) == ["out.bin"]
    with pytest.raises(ValueError, match=r"Writer\(out.bin\): the file is closed"):
        out.write(b"more")


def test_a_discarded_or_dropped_output_file_leaves_the_file_there_unchanged(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"before")
    out = OutputFile(str(path), "w")
    out.write(b"new")
    out.discard()
    out.discard()  # idempotent
    dropped = OutputFile(str(path), "w")
    dropped.write(b"new")
    del dropped
    assert path.read_bytes() == b"before" and os.listdir(tmp_path) == ["out.bin"]


def test_a_write_that_fails_discards_the_file(tmp_path):
    out = OutputFile(str(tmp_path / "out.bin"), "w")
    with pytest.raises(TypeError):
        out.write(object())
    assert out.closed and os.listdir(tmp_path) == []


def test_a_path_dataset_takes_a_path_a_list_or_a_dataset(tmp_path):
    assert list(path_dataset("op", tmp_path / "a")) == [str(tmp_path / "a")]
    assert list(path_dataset("op", ["x-{0..1}", b"y"], braces=True)) == ["x-0", "x-1", "y"]
    names = tp.from_iterable(["a"])
    assert path_dataset("op", names) is names
    with pytest.raises(ValueError, match="op: no filenames given"):
        path_dataset("op", [])
    with pytest.raises(TypeError, match="op: filenames must be a path, a list of paths"):
        path_dataset("op", 3)


class _Lines(FileReaderIterator):
    """Reads a file's lines; fails on a line that says so."""

    def read_next(self):
        if self._stream is None:
            self._stream = open(self.path, "rb")
            self._stream.seek(self._offset)
        line = self._stream.readline()
        if not line:
            raise StopIteration
        if line.startswith(b"corrupt"):
            raise DataLossError(f"{self.path}: corrupt", self.path, self._offset)
        self._offset += len(line)
        return line


def test_a_file_reader_ends_its_file_after_an_error_and_counts_corruption(tmp_path):
    path = tmp_path / "lines"
    path.write_bytes(b"one\ncorrupt\nthree\n")
    reader = _Lines("lines", str(path))
    assert next(reader) == b"one\n"
    with pytest.raises(DataLossError):
        next(reader)
    with pytest.raises(StopIteration):  # the file ended: reading goes on at the next one
        next(reader)
    assert reader.stats.counters["corrupt"] == 1 and reader._stream is None
    assert reader.get_state() == {"file": str(path), "offset": 4, "done": True}


def test_a_file_reader_resumes_its_own_file_and_refuses_another(tmp_path):
    path = tmp_path / "lines"
    path.write_bytes(b"one\ntwo\n")
    reader = _Lines("lines", str(path))
    reader.set_state({"file": str(path), "offset": 4, "done": False})
    assert list(reader) == [b"two\n"]
    with pytest.raises(CheckpointError, match="lines: the checkpoint is of file 'other'"):
        reader.set_state({"file": "other", "offset": 0, "done": False})
    with pytest.raises(CheckpointError, match="lines: state is missing"):
        reader.set_state({"file": str(path)})

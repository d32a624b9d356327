"""The file behind ``cache(path)`` (``torchpipe/storage/cache_file.py``): its header, records and
footer written and read back; a file published only when complete, the first complete one winning
over a later one and a stale one replaced; an interrupted fill resumed from its checkpoint; every
kind of damage a CacheFormatError; records read as data, never code; and ``FileStorage``'s choice
between replaying, refilling and warning."""

from __future__ import annotations

import glob
import io
import os
import pathlib
import struct

import pytest
import torch

from torchpipe.errors import UntrustedTypeError
from torchpipe.runtime import codec
from torchpipe.storage import cache_file as cf
from torchpipe.storage.cache_file import (
    FOOTER,
    RECORD,
    VERSION,
    CacheFormatError,
    CacheReader,
    CacheWriter,
    FileStorage,
    StaleCacheWarning,
    file_header,
    frame_record,
    read_header,
    record_crc,
)

UPSTREAM = ["map(fn=f#0123456789ab)", "range(start=0, stop=3, step=1, len=3)"]
ORIGIN = (7, 1, (2,))
ELEMENTS = [0, "one", {"two": torch.arange(2)}, (3.0, [b"3"])]


class Planted:
    """An element whose pickle creates ``marker`` when full pickle reads it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _fill(path, elements=ELEMENTS, upstream=UPSTREAM, origin=ORIGIN) -> str:
    writer = CacheWriter.create(str(path), origin, upstream, total=len(elements))
    for element in elements:
        writer.add(element)
    writer.commit()
    return str(path)


def _read_all(path, trusted=False):
    reader = CacheReader(str(path), trusted)
    try:
        out = []
        while True:
            try:
                out.append(reader.next())
            except StopIteration:
                return out
    finally:
        reader.close()


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, dict):
            assert g.keys() == e.keys() and all(torch.equal(g[k], e[k]) for k in e)
        else:
            assert g == e


def _records(path) -> tuple[bytes, list[tuple[int, bytes]], bytes]:
    """The header, the (index, payload) records and the footer of a cache file."""
    data = pathlib.Path(path).read_bytes()
    _, start, _ = read_header(io.BytesIO(data), path)
    pos, records = start, []
    while pos < len(data) - FOOTER.size:
        length, index, _ = RECORD.unpack_from(data, pos)
        records.append((index, data[pos + RECORD.size : pos + RECORD.size + length]))
        pos += RECORD.size + length
    return data[:start], records, data[pos:]


def _write(path, header, records, footer=None) -> str:
    body = b"".join(frame_record(i, p) + p for i, p in records)
    if footer is None:
        footer = FOOTER.pack(len(records), len(body), cf.END_MAGIC)
    with open(path, "wb") as f:
        f.write(header + body + footer)
    return str(path)


# -- header and framing --------------------------------------------------------------------------
def test_a_header_reads_back_its_origin_and_pipeline():
    header = file_header(ORIGIN, UPSTREAM)
    assert header.startswith(b"TPCACHE\0") and struct.unpack_from("<I", header, 8)[0] == VERSION
    version, start, meta = read_header(io.BytesIO(header + b"records"), "f")
    assert (version, start) == (VERSION, len(header))
    assert cf.origin_of(meta["origin"]) == ORIGIN and meta["pipeline"] == UPSTREAM


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"TPCACHE\0\x03\0", "is truncated \\(no complete header\\)"),
        (
            b"NOTCACHE" + struct.pack("<II", VERSION, 0),
            "is not a torchpipe cache file \\(bad magic",
        ),
        (
            struct.pack("<8sII", b"TPCACHE\0", VERSION + 1, 0),
            f"has format version {VERSION + 1}, from a newer torchpipe",
        ),
        (struct.pack("<8sII", b"TPCACHE\0", VERSION, 5) + b"{nope", "has a corrupt header"),
        (
            struct.pack("<8sII", b"TPCACHE\0", VERSION, 20) + b'{"origin": [1, 2, []]',
            "has a corrupt header",
        ),
        (struct.pack("<8sII", b"TPCACHE\0", VERSION, 2) + b"[]", "has a corrupt header"),
        (
            struct.pack("<8sII", b"TPCACHE\0", VERSION, 39)
            + b'{"origin": [1, 2], "pipeline": ["op()"]}',
            "corrupt",
        ),
        (
            struct.pack("<8sII", b"TPCACHE\0", VERSION, 42)
            + b'{"origin": [1, 2, []], "pipeline": "op()"}',
            "corrupt",
        ),
    ],
)
def test_a_bad_header_is_a_cache_format_error(data, message):
    with pytest.raises(CacheFormatError, match=message):
        read_header(io.BytesIO(data), "f")


def test_a_header_of_an_older_version_gives_its_version_and_no_meta():
    data = struct.pack("<8sII", b"TPCACHE\0", VERSION - 1, 4) + b"junk"
    assert read_header(io.BytesIO(data), "f") == (VERSION - 1, 20, {})


def test_a_records_crc_covers_its_index_and_payload():
    assert record_crc(0, b"payload") != record_crc(1, b"payload")
    assert record_crc(0, b"payload") != record_crc(0, b"payloae")
    assert frame_record(3, b"abc") == RECORD.pack(3, 3, record_crc(3, b"abc"))


# -- writing and reading -------------------------------------------------------------------------
def test_a_filled_file_reads_back_its_elements_origin_and_pipeline(tmp_path):
    path = _fill(tmp_path / "c")
    reader = CacheReader(path)
    assert (reader.version, reader.origin, reader.upstream, reader.count) == (
        VERSION,
        ORIGIN,
        UPSTREAM,
        4,
    )
    reader.close()
    _assert_same(_read_all(path), ELEMENTS)
    assert glob.glob(path + ".tmp-*") == []


def test_an_empty_fill_is_a_file_of_no_records(tmp_path):
    assert _read_all(_fill(tmp_path / "c", [])) == []


def test_a_file_is_published_only_when_committed_and_a_discarded_fill_leaves_nothing(tmp_path):
    path = str(tmp_path / "c")
    writer = CacheWriter.create(path, ORIGIN, UPSTREAM)
    writer.add(1)
    assert not os.path.exists(path) and os.path.exists(writer.temp)
    writer.discard()
    assert os.listdir(tmp_path) == []


def test_the_first_complete_file_wins_over_a_later_one_of_the_same_pipeline(tmp_path):
    path = str(tmp_path / "c")
    first, second = (
        CacheWriter.create(path, ORIGIN, UPSTREAM),
        CacheWriter.create(path, ORIGIN, UPSTREAM),
    )
    first.add("first")
    second.add("second")
    first.commit()
    second.commit()
    assert _read_all(path) == ["first"]
    assert os.listdir(tmp_path) == ["c"]


def test_a_complete_file_replaces_another_pipelines(tmp_path):
    path = _fill(tmp_path / "c", ["old"], upstream=["other()"])
    _fill(path, ["new"])
    assert _read_all(path) == ["new"]


def test_a_checkpointed_fill_resumes_where_it_was_and_drops_what_came_after(tmp_path):
    path = str(tmp_path / "c")
    writer = CacheWriter.create(path, ORIGIN, UPSTREAM)
    writer.add("a")
    state = writer.state()
    assert state == {"temp": writer.temp, "offset": writer.offset, "written": 1}
    writer.add("lost")  # written after the checkpoint: a resume overwrites it
    writer._pending.close(sync=False)  # the process is killed: its lock goes, its file stays
    resumed = CacheWriter.resume(path, state, UPSTREAM)
    assert resumed is not None and resumed.count == 1
    resumed.add("b")
    resumed.commit()
    assert _read_all(path) == ["a", "b"]
    writer.discard()


def test_a_checkpoint_that_cannot_be_resumed_gives_none(tmp_path):
    path = str(tmp_path / "c")
    writer = CacheWriter.create(path, ORIGIN, UPSTREAM)
    writer.add("a")
    state = writer.state()
    writer._pending.close(sync=False)
    assert CacheWriter.resume(path, {**state, "temp": None}, UPSTREAM) is None
    assert CacheWriter.resume(path, {**state, "temp": str(tmp_path / "gone")}, UPSTREAM) is None
    assert CacheWriter.resume(path, state, ["another()"]) is None
    assert CacheWriter.resume(path, {**state, "offset": 10**6}, UPSTREAM) is None
    assert CacheWriter.resume(path, {**state, "offset": 3}, UPSTREAM) is None  # inside the header
    resumed = CacheWriter.resume(path, state, UPSTREAM)
    assert resumed is not None  # the state itself is usable
    # but not while another writer holds it
    assert CacheWriter.resume(path, state, UPSTREAM) is None
    resumed.discard()
    writer.discard()


def test_a_fill_in_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory .*missing.* does not exist"):
        CacheWriter.create(str(tmp_path / "missing" / "c"), ORIGIN, UPSTREAM)


def test_a_reader_resumes_at_its_state(tmp_path):
    path = _fill(tmp_path / "c", ["a", "b", "c"])
    reader = CacheReader(path)
    reader.next()
    state = reader.state()
    reader.close()
    again = CacheReader(path)
    assert again.seek(state["position"], state["offset"])
    assert [again.next(), again.next()] == ["b", "c"]
    with pytest.raises(StopIteration):
        again.next()
    assert not again.seek(4, state["offset"]) and not again.seek(-1, state["offset"])
    assert not again.seek(0, 0) and not again.seek(0, os.path.getsize(path))
    again.close()


# -- damage --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [-1, -FOOTER.size, -FOOTER.size - 1])
def test_a_truncated_file_is_refused_on_open(tmp_path, cut):
    path = _fill(tmp_path / "c")
    data = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(data[:cut])
    with pytest.raises(CacheFormatError, match="is truncated"):
        CacheReader(path)


def test_a_header_only_file_is_truncated_with_no_footer(tmp_path):
    path = tmp_path / "c"
    path.write_bytes(file_header(ORIGIN, UPSTREAM))
    with pytest.raises(CacheFormatError, match="is truncated \\(no footer\\)"):
        CacheReader(str(path))


def test_a_bad_footer_magic_is_refused_on_open(tmp_path):
    path = _fill(tmp_path / "c")
    data = bytearray(pathlib.Path(path).read_bytes())
    data[-1] ^= 0xFF
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="truncated or corrupt \\(bad footer\\)"):
        CacheReader(path)


def _damaged(path, message):
    reader = CacheReader(path)
    got = []
    with pytest.raises(CacheFormatError, match=f"cache file .* is damaged: {message}"):
        while True:
            got.append(reader.next())
    with pytest.raises(StopIteration):  # nothing after the damage is read
        reader.next()
    reader.close()
    return got


def test_a_flipped_payload_byte_fails_its_checksum(tmp_path):
    path = _fill(tmp_path / "c", ["a", "b", "c"])
    header, records, _ = _records(path)
    last_byte_of_second = (
        len(header) + RECORD.size + len(records[0][1]) + RECORD.size + len(records[1][1]) - 1
    )
    data = bytearray(pathlib.Path(path).read_bytes())
    data[last_byte_of_second] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))
    assert _damaged(path, "record 1 fails its checksum") == ["a"]


def test_records_out_of_order_are_an_error_not_a_reorder(tmp_path):
    path = _fill(tmp_path / "c", ["a", "b"])
    header, records, _ = _records(path)
    _write(path, header, list(reversed(records)))
    assert _damaged(path, "record 1 is where record 0 belongs \\(records out of order\\)") == []


def test_a_footer_counting_fewer_records_than_the_data_holds_is_damage(tmp_path):
    path = _fill(tmp_path / "c", ["a", "b"])
    header, records, _ = _records(path)
    body_bytes = sum(RECORD.size + len(p) for _, p in records)
    _write(path, header, records, FOOTER.pack(1, body_bytes, cf.END_MAGIC))
    assert _damaged(path, "has data after its last record") == ["a"]


def test_a_footer_counting_more_records_than_the_data_holds_is_damage(tmp_path):
    path = _fill(tmp_path / "c", ["a", "b"])
    header, records, _ = _records(path)
    body_bytes = sum(RECORD.size + len(p) for _, p in records)
    _write(path, header, records, FOOTER.pack(3, body_bytes, cf.END_MAGIC))
    assert _damaged(path, "record 2 runs past the data") == ["a", "b"]


def test_a_payload_that_is_not_an_element_cannot_be_read(tmp_path):
    path = _fill(tmp_path / "c", ["a"])
    header, _, _ = _records(path)
    _write(path, header, [(0, b"\x00not an element")])
    assert _damaged(path, "record 0 cannot be read") == []


def test_an_older_versions_file_is_not_read(tmp_path):
    path = tmp_path / "c"
    path.write_bytes(struct.pack("<8sII", b"TPCACHE\0", VERSION - 1, 0) + codec.encode_bytes("old"))
    reader = CacheReader(str(path))
    assert reader.version == VERSION - 1
    with pytest.raises(CacheFormatError, match="from an older torchpipe"):
        reader.next()
    reader.close()


# -- data, never code ----------------------------------------------------------------------------
def test_a_record_naming_code_raises_and_runs_nothing_unless_trusted(tmp_path):
    marker = tmp_path / "ran"
    path = _fill(tmp_path / "c", ["a", Planted(marker)])
    reader = CacheReader(path)
    assert reader.next() == "a"
    with pytest.raises(UntrustedTypeError) as info:
        reader.next()
    reader.close()
    assert not marker.exists()
    assert f"reading record 1 of the cache file {path!r}" in info.value.__notes__
    first, opened = _read_all(path, trusted=True)  # full pickle runs what the record names
    opened.close()
    assert first == "a" and marker.exists()


# -- FileStorage ---------------------------------------------------------------------------------
def test_storage_replays_a_current_file_of_the_same_pass(tmp_path):
    path = _fill(tmp_path / "c", ["a", "b"])
    storage = FileStorage(path, UPSTREAM)
    reader = storage.replay(ORIGIN, None)
    assert reader is not None and reader.next() == "a"
    state = reader.state()
    reader.close()
    resumed = storage.replay(ORIGIN, state)
    assert resumed.next() == "b"
    resumed.close()
    any_pass = storage.replay(None, None)
    assert any_pass is not None
    any_pass.close()


def test_storage_gives_none_for_no_file_another_pass_or_a_bad_position(tmp_path):
    path = str(tmp_path / "c")
    storage = FileStorage(path, UPSTREAM)
    assert storage.replay(ORIGIN, None) is None
    _fill(path)
    assert storage.replay((8, 1, (2,)), None) is None
    assert storage.replay(ORIGIN, {"position": 99, "offset": 0}) is None


def test_storage_warns_of_a_file_another_pipeline_wrote_naming_the_changed_op(tmp_path):
    path = _fill(tmp_path / "c", upstream=["map(fn=g#aaaaaaaaaaaa)", UPSTREAM[1]])
    with pytest.warns(
        StaleCacheWarning,
        match="op 0 was map\\(fn=g#aaaaaaaaaaaa\\), now map\\(fn=f#0123456789ab\\)",
    ):
        assert FileStorage(path, UPSTREAM).replay(ORIGIN, None) is None
    with pytest.warns(StaleCacheWarning, match="ops \\["):
        assert FileStorage(path, UPSTREAM[:1]).replay(ORIGIN, None) is None


def test_storage_warns_of_an_older_versions_file(tmp_path):
    path = tmp_path / "c"
    path.write_bytes(struct.pack("<8sII", b"TPCACHE\0", VERSION - 1, 0))
    with pytest.warns(
        StaleCacheWarning, match=f"format version {VERSION - 1}, from an older torchpipe"
    ):
        assert FileStorage(str(path), UPSTREAM).replay(ORIGIN, None) is None


def test_storage_at_a_directory_says_it_wants_a_file_name(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory; expected a file name"):
        FileStorage(str(tmp_path), UPSTREAM).replay(ORIGIN, None)


def test_temporary_files_no_writer_holds_are_removed_once_a_file_is_complete(tmp_path):
    path = str(tmp_path / "c")
    (tmp_path / "c.tmp-1-left").write_bytes(b"killed")
    live = CacheWriter.create(path, ORIGIN, UPSTREAM)  # holds its temporary file locked
    _fill(path)
    assert sorted(os.listdir(tmp_path)) == sorted(["c", os.path.basename(live.temp)])
    live.discard()

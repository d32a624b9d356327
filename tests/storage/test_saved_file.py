"""Saved datasets on disk (``torchpipe/storage/saved_file.py``): shards and a manifest written and
read back as a map-style dataset, per-record compression, shards published only when finished and
resumed from a checkpoint, manifests that name only files next to them, and every kind of damage
(manifest, index, shard size, record) as the documented error; records read as data, never code."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import zlib

import pytest
import torch

from torchpipe.errors import DataLossError, UntrustedTypeError
from torchpipe.runtime import codec
from torchpipe.storage.saved_file import (
    ENTRY,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SavedFormatError,
    SavedRecords,
    ShardFile,
    check_compression,
    compress,
    decompress,
    lock_directory,
    new_generation,
    read_manifest,
    remove_files,
    shard_name,
    write_manifest,
)

ORIGIN = (5, 0, ())
PIPELINE = ["range(start=0, stop=5, step=1, len=5)"]


class Planted:
    """An element whose pickle creates ``marker`` when full pickle reads it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _save(directory, shards, compression=None, generation="0badcafe") -> str:
    """Write ``shards`` (lists of ``(element index, element)``) and their manifest; the path."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    entries = []
    for number, records in enumerate(shards):
        shard = ShardFile.create(directory, shard_name(generation, number), ORIGIN, PIPELINE)
        for index, element in records:
            shard.add(index, compress(codec.encode_bytes(element), compression))
        entries.append(shard.finish())
    count = sum(len(records) for records in shards)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "generation": generation,
        "count": count,
        "compression": compression,
        "origin": [ORIGIN[0], ORIGIN[1], []],
        "shards": entries,
        "pipeline": PIPELINE,
        "element_spec": {"kind": "any"},
    }
    write_manifest(directory, manifest)
    return directory


def _manifest(directory) -> dict:
    return json.loads((pathlib.Path(directory) / MANIFEST).read_text())


def _rewrite_manifest(directory, **changes) -> None:
    manifest = {**_manifest(directory), **changes}
    (pathlib.Path(directory) / MANIFEST).write_text(json.dumps(manifest))


# -- names and compression -----------------------------------------------------------------------
def test_names_of_generations_and_shards():
    generation = new_generation()
    assert len(generation) == 8 and int(generation, 16) >= 0 and new_generation() != generation
    assert shard_name("0badcafe", 12) == "shard-0badcafe-00012"


@pytest.mark.parametrize(
    ("given", "taken"), [(None, None), ("GZIP", "GZIP"), ("gzip", "GZIP"), ("zlib", "ZLIB")]
)
def test_check_compression_takes_the_supported_ones_in_any_case(given, taken):
    assert check_compression(given) == taken


@pytest.mark.parametrize("given", ["", "NONE", "lz4", 1])
def test_an_unsupported_compression_is_a_value_error_naming_the_supported(given):
    with pytest.raises(ValueError, match=r"compression must be one of \[None, 'GZIP', 'ZLIB'\]"):
        check_compression(given)


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_a_payload_round_trips_through_each_compression(compression):
    payload = b"abc" * 100
    packed = compress(payload, compression)
    assert decompress(packed, compression) == payload
    assert (packed == payload) == (compression is None)
    if compression == "GZIP":
        assert packed[:2] == b"\x1f\x8b"


# -- writing and reading -------------------------------------------------------------------------
@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_saved_shards_read_back_as_a_map_style_dataset(tmp_path, compression):
    elements = [0, "one", {"two": [2]}, (3.0, b"3"), None]
    # element indexes are spread over the shards out of order, as parallel writers leave them
    _save(
        tmp_path,
        [
            [(4, elements[4]), (0, elements[0])],
            [],
            [(2, elements[2]), (1, elements[1]), (3, elements[3])],
        ],
        compression,
    )
    records = SavedRecords(tmp_path)
    assert len(records) == 5 and [records[i] for i in range(5)] == elements
    assert records[-1] is None and records[-5] == 0
    assert records.origin == ORIGIN and records.element_spec == {"kind": "any"}
    assert repr(records) == f"SavedRecords({str(tmp_path)!r}, 5 elements)"


def test_a_tensor_reads_back_equal(tmp_path):
    _save(tmp_path, [[(0, torch.arange(6).reshape(2, 3))]])
    assert torch.equal(SavedRecords(tmp_path)[0], torch.arange(6).reshape(2, 3))


def test_an_empty_dataset_reads_as_no_elements(tmp_path):
    _save(tmp_path, [])
    records = SavedRecords(tmp_path)
    assert len(records) == 0
    with pytest.raises(IndexError):
        records[0]


def test_an_index_out_of_range_is_an_index_error_naming_the_dataset(tmp_path):
    _save(tmp_path, [[(0, "a"), (1, "b")]])
    records = SavedRecords(tmp_path)
    for i in (2, -3):
        with pytest.raises(IndexError, match=f"index {i} out of range for 2 elements"):
            records[i]


def test_saved_records_pickle_and_read_the_same_elements(tmp_path):
    _save(tmp_path, [[(0, "a"), (1, "b")]])
    records = pickle.loads(pickle.dumps(SavedRecords(tmp_path)))
    assert [records[0], records[1]] == ["a", "b"]


def test_a_shard_is_partial_until_finished_and_its_entry_describes_it(tmp_path):
    shard = ShardFile.create(str(tmp_path), "shard-x-00000", ORIGIN, PIPELINE)
    shard.add(0, codec.encode_bytes("a"))
    assert sorted(os.listdir(tmp_path)) == [
        "shard-x-00000.index.partial",
        "shard-x-00000.records.partial",
    ]
    entry = shard.finish()
    assert sorted(os.listdir(tmp_path)) == ["shard-x-00000.index", "shard-x-00000.records"]
    assert (
        entry["records_file"] == "shard-x-00000.records"
        and entry["index_file"] == "shard-x-00000.index"
    )
    assert entry["records"] == 1 and entry["bytes"] == os.path.getsize(
        tmp_path / "shard-x-00000.records"
    )
    assert (tmp_path / "shard-x-00000.index").stat().st_size == ENTRY.size


def test_a_shard_resumes_at_its_checkpoint_and_drops_what_came_after(tmp_path):
    name = "shard-x-00000"
    shard = ShardFile.create(str(tmp_path), name, ORIGIN, PIPELINE)
    shard.add(0, codec.encode_bytes("a"))
    shard.flush(sync=False)
    offset, count = shard.offset, shard.count
    shard.add(1, codec.encode_bytes("lost"))
    shard.close()
    resumed = ShardFile.resume(str(tmp_path), name, offset, count, PIPELINE)
    resumed.add(1, codec.encode_bytes("b"))
    entry = resumed.finish()
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "count": 2,
        "compression": None,
        "origin": [5, 0, []],
        "shards": [entry],
    }
    write_manifest(str(tmp_path), manifest)
    records = SavedRecords(tmp_path)
    assert [records[0], records[1]] == ["a", "b"]


def test_a_shard_that_cannot_be_resumed_is_a_saved_format_error(tmp_path):
    name = "shard-x-00000"
    with pytest.raises(SavedFormatError, match="cannot resume shard shard-x-00000"):
        ShardFile.resume(str(tmp_path), name, 0, 0, PIPELINE)  # no files
    shard = ShardFile.create(str(tmp_path), name, ORIGIN, PIPELINE)
    shard.add(0, codec.encode_bytes("a"))
    shard.flush(sync=False)
    offset = shard.offset
    shard.close()
    for args in (
        (offset + 1, 1, PIPELINE),
        (offset, 2, PIPELINE),
        (offset, 1, ["other()"]),
        (3, 0, PIPELINE),
    ):
        with pytest.raises(
            SavedFormatError,
            match="shorter than the checkpoint or were written by another pipeline",
        ):
            ShardFile.resume(str(tmp_path), name, *args)
    # the checkpoint itself resumes
    ShardFile.resume(str(tmp_path), name, offset, 1, PIPELINE).close()


# -- the manifest --------------------------------------------------------------------------------
def test_a_manifest_reads_back_as_written(tmp_path):
    _save(tmp_path, [[(0, "a")]])
    assert read_manifest(str(tmp_path)) == _manifest(tmp_path)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(f"{MANIFEST}.tmp-")]


def test_no_manifest_or_no_directory_is_file_not_found_saying_why(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="it has no manifest.json .*saving again resumes it"
    ):
        read_manifest(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_manifest(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        SavedRecords(tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "is not the manifest of a torchpipe saved dataset"),
        (
            {"version": FORMAT_VERSION + 1},
            f"has format version {FORMAT_VERSION + 1}; this torchpipe reads up to",
        ),
        ({"version": "1"}, "has format version '1'"),
        ({"count": "many"}, "is a malformed manifest"),
        ({"compression": "lz4"}, "is a malformed manifest"),
        ({"origin": [1, 2]}, "is a malformed manifest"),
        ({"shards": [{"records_file": "a"}]}, "is a malformed manifest"),
        ({"shards": 3}, "is a malformed manifest"),
        ({"count": 2}, "the shards' records do not add up to the count 2"),
    ],
)
def test_a_malformed_manifest_is_a_saved_format_error(tmp_path, changes, message):
    _save(tmp_path, [[(0, "a")]])
    _rewrite_manifest(tmp_path, **changes)
    with pytest.raises(SavedFormatError, match=message):
        read_manifest(str(tmp_path))


def test_a_manifest_that_is_not_json_or_not_an_object_is_a_saved_format_error(tmp_path):
    (tmp_path / MANIFEST).write_bytes(b"\xff{")
    with pytest.raises(SavedFormatError, match="is not a valid manifest"):
        read_manifest(str(tmp_path))
    (tmp_path / MANIFEST).write_text("[]")
    with pytest.raises(SavedFormatError, match="is not the manifest of a torchpipe saved dataset"):
        read_manifest(str(tmp_path))


@pytest.mark.parametrize(
    "name", ["../shard.records", "/etc/passwd", "sub/shard.records", "", ".", "..", "a\0b", 7]
)
def test_a_manifest_naming_a_file_outside_its_directory_is_refused(tmp_path, name):
    _save(tmp_path, [[(0, "a")]])
    shards = _manifest(tmp_path)["shards"]
    shards[0]["index_file"] = name
    _rewrite_manifest(tmp_path, shards=shards)
    with pytest.raises(
        SavedFormatError, match="is not a plain file name in the manifest's directory"
    ):
        read_manifest(str(tmp_path))


def test_a_lowercase_compression_in_a_manifest_reads_as_that_compression(tmp_path):
    _save(tmp_path, [[(0, "a")]], compression="GZIP")
    # accepted by check_compression, so read as GZIP
    _rewrite_manifest(tmp_path, compression="gzip")
    assert SavedRecords(tmp_path)[0] == "a"


# -- damage --------------------------------------------------------------------------------------
def test_a_missing_shard_file_is_an_incomplete_dataset(tmp_path):
    _save(tmp_path, [[(0, "a")]])
    os.remove(tmp_path / "shard-0badcafe-00000.index")
    with pytest.raises(SavedFormatError, match="is incomplete"):
        SavedRecords(tmp_path)


def test_a_shard_of_another_size_than_its_manifest_says_is_refused(tmp_path):
    _save(tmp_path, [[(0, "a")]])
    with open(tmp_path / "shard-0badcafe-00000.records", "ab") as f:
        f.write(b"x")
    with pytest.raises(SavedFormatError, match="has .* bytes, its manifest says"):
        SavedRecords(tmp_path)


def test_a_damaged_index_is_refused(tmp_path):
    _save(tmp_path, [[(0, "a"), (1, "b")]])
    index = tmp_path / "shard-0badcafe-00000.index"
    data = bytearray(index.read_bytes())
    data[0] ^= 1
    index.write_bytes(bytes(data))
    with pytest.raises(
        SavedFormatError, match="is damaged \\(its CRC or length does not match the manifest\\)"
    ):
        SavedRecords(tmp_path)


def test_shards_that_do_not_hold_each_element_exactly_once_are_refused(tmp_path):
    _save(tmp_path, [[(0, "a")], [(0, "again")]])
    with pytest.raises(SavedFormatError, match="do not hold elements 0..1 exactly once each"):
        SavedRecords(tmp_path)
    _save(tmp_path / "gap", [[(0, "a"), (2, "c")]])
    with pytest.raises(SavedFormatError, match="exactly once"):
        SavedRecords(tmp_path / "gap")


def _flip_record_byte(directory, element, from_end=1):
    """Flip a byte of ``element``'s record in the shard; returns the record's offset."""
    entries = (pathlib.Path(directory) / "shard-0badcafe-00000.index").read_bytes()
    for i in range(0, len(entries), ENTRY.size):
        index, offset, length = ENTRY.unpack_from(entries, i)
        if index == element:
            path = pathlib.Path(directory) / "shard-0badcafe-00000.records"
            data = bytearray(path.read_bytes())
            data[offset + length - from_end] ^= 1
            path.write_bytes(bytes(data))
            return offset
    raise AssertionError(f"no element {element}")


def test_a_damaged_record_is_a_data_loss_error_naming_file_offset_and_element(tmp_path):
    _save(tmp_path, [[(0, "a"), (1, "b")]])
    offset = _flip_record_byte(tmp_path, 1)
    records = SavedRecords(tmp_path)
    assert records[0] == "a"
    with pytest.raises(
        DataLossError, match=f"damaged record at byte {offset} \\(element 1\\)"
    ) as info:
        records[1]
    assert info.value.offset == offset and info.value.path.endswith("shard-0badcafe-00000.records")


def test_a_record_in_the_place_of_another_is_a_data_loss_error(tmp_path):
    _save(tmp_path, [[(0, "a"), (1, "b")]])
    index = tmp_path / "shard-0badcafe-00000.index"
    entries = index.read_bytes()
    first, second = entries[: ENTRY.size], entries[ENTRY.size :]
    swapped = ENTRY.pack(0, *ENTRY.unpack(second)[1:]) + ENTRY.pack(1, *ENTRY.unpack(first)[1:])
    index.write_bytes(swapped)
    shards = _manifest(tmp_path)["shards"]
    shards[0]["index_crc32"] = zlib.crc32(swapped)
    _rewrite_manifest(tmp_path, shards=shards)
    with pytest.raises(DataLossError, match="is element 1, not 0"):
        SavedRecords(tmp_path)[0]


def test_a_record_that_does_not_decode_is_a_data_loss_error(tmp_path):
    _save(tmp_path, [[(0, "a")]], compression="GZIP")
    _rewrite_manifest(tmp_path, compression="ZLIB")  # the records are not ZLIB streams
    with pytest.raises(DataLossError, match="\\(element 0\\) cannot be decoded"):
        SavedRecords(tmp_path)[0]


# -- data, never code ----------------------------------------------------------------------------
def test_a_record_naming_code_raises_and_runs_nothing_unless_trusted(tmp_path):
    marker = tmp_path / "ran"
    _save(tmp_path / "d", [[(0, "a"), (1, Planted(marker))]])
    records = SavedRecords(tmp_path / "d")
    assert records[0] == "a"
    with pytest.raises(UntrustedTypeError) as info:
        records[1]
    assert not marker.exists()
    assert any("reading element 1 of the saved dataset" in note for note in info.value.__notes__)
    SavedRecords(tmp_path / "d", trusted=True)[1].close()
    assert marker.exists()


# -- the directory -------------------------------------------------------------------------------
def test_one_process_at_a_time_holds_a_directorys_lock(tmp_path):
    held = lock_directory(str(tmp_path))
    assert held is not None
    assert lock_directory(str(tmp_path)) is None
    held.close()
    again = lock_directory(str(tmp_path))
    assert again is not None
    again.close()


def test_a_planted_lock_symlink_is_refused(tmp_path):
    (tmp_path / "target").write_bytes(b"")
    os.symlink(tmp_path / "target", tmp_path / ".lock")
    with pytest.raises(OSError):
        lock_directory(str(tmp_path))


def test_remove_files_keeps_only_the_published_generation_and_the_manifest(tmp_path):
    names = [
        "shard-keep-00000.records",
        "shard-keep-00000.index",
        "shard-keep-00001.records.partial",
        "shard-old-00000.records",
        f"{MANIFEST}.tmp-1",
        MANIFEST,
        ".lock",
        "other.txt",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    remove_files(str(tmp_path), keep="keep")
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["shard-keep-00000.records", "shard-keep-00000.index", MANIFEST, ".lock", "other.txt"]
    )
    remove_files(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([MANIFEST, ".lock", "other.txt"])

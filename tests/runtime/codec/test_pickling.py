"""bytes, bytearray and str in element records: pickled into the skeleton while small, raw
buffers (one copy each side, no pickling) from ``codec_pickle.RAW_MIN`` on."""

import mmap
import random
import struct
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from tests.runtime.codec.alignment import aligned_base
from torchpipe.runtime import codec
from torchpipe.runtime.codec.pickling import RAW_MIN
from torchpipe.testing import assert_elements_equal

HEADER = struct.Struct("<4sHHIIQQ")
BLOB_FLAGS = {bytes: 4, bytearray: 8, str: 12}
Row = namedtuple("Row", "id x blob meta")


def layout(record):
    """The buffer flags and the skeleton length of a record."""
    _, _, _, count, _, skeleton_len, _ = HEADER.unpack_from(record)
    table = struct.unpack_from(f"<{2 * count}Q", record, HEADER.size)
    return list(table[1::2]), skeleton_len


def text(n, seed=0):
    """``n`` characters: ASCII, Latin-1, other BMP and astral ones, NUL and newline; no surrogates."""
    return "".join(random.Random(seed).choices("abcXYZ019 éß€漢字🙂𝄞\n\0", k=n))


def make(cls, n, seed=0):
    if cls is str:
        return text(n, seed)
    return cls(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def decoded(element):
    """The element's record decoded both ways: copied out, and viewed in place (aligned)."""
    record = codec.encode_bytes(element)
    return [codec.decode(memoryview(record)), codec.decode_view(aligned_base(record))]


@pytest.mark.parametrize("cls", [bytes, bytearray, str], ids=lambda cls: cls.__name__)
def test_each_type_round_trips_exactly_below_at_and_above_its_threshold(cls):
    for n in (0, 1, RAW_MIN - 1, RAW_MIN, RAW_MIN + 1, 3 * RAW_MIN + 7):  # str: n characters
        value = make(cls, n, seed=n)
        for out in decoded({"v": value}):
            assert type(out["v"]) is cls and out["v"] == value
        flags, skeleton_len = layout(codec.encode_bytes({"v": value}))
        if n >= RAW_MIN:
            assert flags == [BLOB_FLAGS[cls]] and skeleton_len < 100  # a raw buffer
        else:
            assert flags == [] and skeleton_len > n  # pickled into the skeleton


def test_str_keeps_every_code_point_lone_surrogates_included():
    n = RAW_MIN
    for value in (
        "é" * n,
        "🙂" * n,
        "\U0010ffff" * n,
        "a\0b" * n,
        "\ud800x\udfff" * n,
        "\udc80" + text(n),
    ):
        for out in decoded([value, value[:-1]]):
            assert out == [value, value[:-1]]


def test_blobs_are_copies_that_outlive_the_record():
    element = [make(bytes, RAW_MIN), make(bytearray, RAW_MIN), text(RAW_MIN)]
    base = aligned_base(codec.encode_bytes(element))
    out = codec.decode_view(base)
    base[:] = 0xAB
    assert out == element
    out[1][:4] = b"edit"  # a bytearray of its own
    assert out[1][:4] == b"edit" and element[1][:4] != b"edit"


def rows(count):
    """Rows as Hugging Face datasets and WebDataset produce them, with blobs just large enough
    to be raw buffers."""
    return [
        {
            "id": f"row-{i:08d}",
            "x": np.full(16, i, np.float32),
            "blob": make(bytes, RAW_MIN + 997 * i, seed=i),
            "meta": {"len": i, "tags": ["a", "b"], "caption": text(RAW_MIN + i, seed=i)},
        }
        for i in range(count)
    ]


def test_rows_and_batches_of_rows_round_trip():
    some = rows(8)
    named = [
        Row(
            r["id"],
            torch.from_numpy(r["x"]),
            bytearray(r["blob"]),
            (r["meta"], r["meta"]["caption"]),
        )
        for r in some
    ]
    batch = default_collate(rows(32))
    assert (
        type(batch["blob"]) is list
        and type(batch["id"]) is list
        and type(batch["x"]) is torch.Tensor
    )
    for element in (some[3], some, named, batch, (some[:2], [named[:2]], {"batch": batch})):
        for out in decoded(element):
            assert_elements_equal(out, element)
    flags, skeleton_len = layout(codec.encode_bytes(batch))
    assert flags.count(BLOB_FLAGS[bytes]) == 32 and flags.count(BLOB_FLAGS[str]) == 32
    assert skeleton_len < RAW_MIN  # the 64 blobs are raw buffers


def test_the_same_object_twice_decodes_as_one_object_and_equal_objects_as_two():
    shared, text_value, blob = make(bytearray, RAW_MIN), text(RAW_MIN), make(bytes, RAW_MIN)
    twin, blob_twin = bytearray(shared), blob[:1] + blob[1:]  # equal, but other objects
    element = {
        "a": shared,
        "b": [shared, twin],
        "s": (text_value, text_value),
        "t": [blob, blob_twin, blob],
    }
    flags, _ = layout(codec.encode_bytes(element))
    assert len(flags) == 5  # shared, twin, the text, blob and blob_twin
    for out in decoded(element):
        assert_elements_equal(out, element)
        assert (
            out["b"][0] is out["a"] and out["b"][1] is not out["a"] and out["s"][0] is out["s"][1]
        )
        assert out["t"][0] is out["t"][2] and out["t"][1] is not out["t"][0]
        out["a"][0] ^= 0xFF
        assert out["b"][0][0] == out["a"][0] != out["b"][1][0]


def test_large_blobs_stay_out_of_the_skeleton():
    element = {"b": make(bytes, 1 << 20), "s": text(1 << 18), "ba": make(bytearray, 1 << 19)}
    flags, skeleton_len = layout(codec.encode_bytes(element))
    assert sorted(flags) == [4, 8, 12] and skeleton_len < 100
    for out in decoded(element):
        assert out == element


def test_references_that_mix_up_blobs_and_tensors_are_corrupt_records():
    record = codec.encode_bytes([make(bytes, RAW_MIN), torch.ones(2)])
    flags_at = HEADER.size + 8  # the first buffer's flags
    not_a_blob = bytearray(record)
    struct.pack_into("<Q", not_a_blob, flags_at, 0)
    with pytest.raises(ValueError, match="corrupt element record: no blob in buffer 0"):
        codec.decode(not_a_blob)
    not_a_tensor = bytearray(record)
    struct.pack_into("<Q", not_a_tensor, flags_at + 16, BLOB_FLAGS[bytes])
    with pytest.raises(ValueError, match="corrupt element record: .* references a blob"):
        codec.decode(not_a_tensor)


def test_no_view_of_an_mmap_survives_an_error_after_the_blobs_are_made():
    element = {"s": text(RAW_MIN), "b": make(bytes, RAW_MIN), "t": torch.ones(3)}
    encoded = codec.encode(element)
    region = mmap.mmap(-1, encoded.nbytes)
    encoded.write_into(region)

    def allocate(shape, dtype):
        raise RuntimeError("out of pinned memory")

    with pytest.raises(RuntimeError, match="out of pinned memory") as error:
        codec.decode(region, allocate=allocate)
    region.close()  # BufferError if a slice of it were still alive
    assert error.value.__traceback__ is not None

"""TFRecord framing (``torchpipe/io/tfrecord_framing.py``): the masked CRC32C against the format's
definition, the 12-byte header, reading framed records back (TensorFlow's own file too), and every
kind of damage (a short header, a bad CRC, a length past the file or the maximum, short data or
footer) as a DataLossError naming the file and the record's offset."""

from __future__ import annotations

import io
import os
import pickle
import struct

import pytest

from torchpipe.errors import DataLossError
from torchpipe.io import tfrecord_framing as framing
from torchpipe.io.tfrecord_framing import (
    FOOTER_BYTES,
    HEADER_BYTES,
    frame_header,
    masked_crc,
    read_record,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tensorflow")


def _crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) bit by bit: the definition, independent of the ``crc32c`` package."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _frame(data: bytes) -> bytes:
    return frame_header(len(data)) + data + struct.pack("<I", masked_crc(data))


def _read(buf: bytes, verify: bool = True, limit: int | None = None, offset: int = 0):
    return read_record(io.BytesIO(buf).read, "f.tfrecord", offset, verify, limit)


def _damage(
    buf: bytes, verify: bool = True, limit: int | None = None, offset: int = 0
) -> DataLossError:
    with pytest.raises(DataLossError) as info:
        _read(buf, verify, limit, offset)
    error = info.value
    assert error.path == "f.tfrecord" and error.offset == offset
    assert str(error).startswith("f.tfrecord: ") and f"at byte {offset}" in str(error)
    return error


# -- CRCs and headers ----------------------------------------------------------------------------
def test_crc32c_check_value_and_the_empty_string():
    assert _crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    assert masked_crc(b"") == 0xA282EAD8


@pytest.mark.parametrize("data", [b"", b"a", b"123456789", bytes(range(256)), b"\xff" * 100])
def test_masked_crc_is_the_rotated_crc32c_plus_the_mask_delta(data):
    assert masked_crc(data) == _masked(_crc32c(data))


def test_masked_crc_takes_any_bytes_like_object():
    data = b"some record"
    assert masked_crc(bytearray(data)) == masked_crc(memoryview(data)) == masked_crc(data)


@pytest.mark.parametrize("length", [0, 1, 300, 2**32, 2**64 - 1])
def test_frame_header_is_the_length_and_its_masked_crc(length):
    header = frame_header(length)
    assert len(header) == HEADER_BYTES
    assert struct.unpack("<Q", header[:8])[0] == length
    assert struct.unpack("<I", header[8:])[0] == _masked(_crc32c(header[:8]))


# -- reading -------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 3])
def test_a_framed_record_reads_back(data):
    assert _read(_frame(data)) == data
    assert _read(_frame(data), limit=len(_frame(data))) == data


def test_records_read_one_after_another_and_none_at_a_clean_end():
    stream = io.BytesIO(_frame(b"first") + _frame(b"") + _frame(b"third"))
    got = []
    while (record := read_record(stream.read, "f", stream.tell(), True)) is not None:
        got.append(record)
    assert got == [b"first", b"", b"third"]
    assert read_record(stream.read, "f", stream.tell(), True) is None


def test_tensorflows_file_reads_back_record_by_record_and_our_frames_are_its_bytes():
    path = os.path.join(FIXTURES, "records.tfrecord")
    with open(path, "rb") as f:
        content = f.read()
    stream, records = io.BytesIO(content), []
    while (
        record := read_record(stream.read, path, stream.tell(), True, len(content) - stream.tell())
    ) is not None:
        records.append(record)
    assert len(records) > 1
    assert b"".join(_frame(record) for record in records) == content


# -- damage --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 8, HEADER_BYTES - 1])
def test_a_short_header_is_a_truncated_record(cut):
    error = _damage(_frame(b"data")[:cut], offset=40)
    assert f"truncated record at byte 40: {cut} of its 12 header bytes" in str(error)


@pytest.mark.parametrize(
    "cut", [HEADER_BYTES, HEADER_BYTES + 2, HEADER_BYTES + 4, HEADER_BYTES + 7]
)
def test_short_data_or_footer_is_a_truncated_record_saying_how_much_arrived(cut):
    error = _damage(_frame(b"data")[:cut])
    assert (
        f"truncated record at byte 0: {cut - HEADER_BYTES} of its {4 + FOOTER_BYTES} data and CRC bytes"
        in str(error)
    )


def test_a_corrupt_length_crc_is_a_corrupt_record_unless_not_verified():
    framed = bytearray(_frame(b"data"))
    framed[9] ^= 0x01
    assert "corrupt record at byte 0: the length's CRC does not match" in str(
        _damage(bytes(framed))
    )
    assert _read(bytes(framed), verify=False) == b"data"


def test_a_corrupt_data_crc_is_a_corrupt_record_unless_not_verified():
    framed = bytearray(_frame(b"data"))
    framed[HEADER_BYTES] ^= 0x01
    assert "corrupt record at byte 0: the data's CRC does not match (4 bytes)" in str(
        _damage(bytes(framed))
    )
    assert _read(bytes(framed), verify=False) == b"eata"


def test_a_length_past_the_files_end_is_a_truncated_record_and_is_not_read():
    framed = _frame(b"data") + _frame(b"next")
    error = _damage(framed, limit=HEADER_BYTES + 4 + FOOTER_BYTES - 1)
    assert (
        "truncated record at byte 0: it is 4 bytes long, but the file has 7 bytes after its header"
        in str(error)
    )
    header = frame_header(10**12)  # a huge length with a valid CRC: never allocated
    reads = []

    def read(n):
        reads.append(n)
        return header if len(reads) == 1 else b""

    with pytest.raises(DataLossError, match="it is 1000000000000 bytes long"):
        read_record(read, "f", 0, True, 100)
    assert reads == [HEADER_BYTES]


def test_a_length_above_the_maximum_is_a_corrupt_record(monkeypatch):
    monkeypatch.setattr(framing, "MAX_RECORD_BYTES", 8)
    assert _read(_frame(b"12345678")) == b"12345678"
    error = _damage(_frame(b"123456789"))
    assert "corrupt record at byte 0: its length 9 is above the 8-byte maximum" in str(error)


def test_a_long_record_is_read_in_pieces_and_a_short_stream_costs_only_what_it_holds(monkeypatch):
    monkeypatch.setattr(framing, "_READ_PIECE", 4)
    data = bytes(range(10))
    assert _read(_frame(data)) == data
    reads = []
    stream = io.BytesIO(frame_header(1000) + b"abcdef")

    def read(n):
        reads.append(n)
        return stream.read(n)

    with pytest.raises(
        DataLossError, match="truncated record at byte 0: 6 of its 1004 data and CRC bytes"
    ):
        read_record(read, "f", 0, True)
    assert reads[1:3] == [4, 4] and max(reads) <= HEADER_BYTES


def test_a_data_loss_error_pickles_with_its_path_and_offset():
    error = pickle.loads(pickle.dumps(_damage(_frame(b"data")[:5], offset=7)))
    assert isinstance(error, DataLossError) and (error.path, error.offset) == ("f.tfrecord", 7)

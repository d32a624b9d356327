"""TFRecord framing: a record's length, its CRCs, and reading one framed record.

Each record of a TFRecord file is framed as::

    uint64 length (little-endian)
    uint32 masked CRC32C of the 8 length bytes
    byte   data[length]
    uint32 masked CRC32C of data

where ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32). The reader
(``io/tfrecord.py``), the writer, the indexes (``io/index.py``) and the reads by address
(``io/addresses.py``) frame records here.

A record's length is bounded: above :data:`MAX_RECORD_BYTES`, or past what the file holds where
its size is known (uncompressed local files), the length is damage, a
:class:`~torchpipe.errors.DataLossError`, and nothing of that length is allocated. A compressed
stream's record is read in pieces of :data:`_READ_PIECE` bytes, so a length the stream does not
hold costs no more memory than the stream's data.
"""

from __future__ import annotations

import struct
from typing import Any

import crc32c

from torchpipe.errors import DataLossError

_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_HEADER = struct.Struct("<QI")
HEADER_BYTES = 12
FOOTER_BYTES = 4
_MASK_DELTA = 0xA282EAD8
MAX_RECORD_BYTES = 1 << 31
"""The longest record read (2 GiB, protobuf's limit for a ``tf.train.Example``): a longer length is
a :class:`~torchpipe.errors.DataLossError`. Reassign it (``tp.io.tfrecord_framing.MAX_RECORD_BYTES``)
for longer records."""
_READ_PIECE = 64 << 20


def masked_crc(data: Any) -> int:
    """The masked CRC32C that TFRecord stores for ``data`` (any bytes-like object)."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_header(length: int) -> bytes:
    """The 12 bytes before a record of ``length`` bytes: its length and the length's CRC."""
    encoded = _LENGTH.pack(length)
    return encoded + _CRC.pack(masked_crc(encoded))


def _read_pieces(read: Any, length: int) -> bytes:
    """Up to ``length`` bytes, read a piece at a time: a stream shorter than ``length`` (a damaged
    length) costs what it holds, not ``length``."""
    pieces = []
    left = length
    while left:
        piece = read(min(left, _READ_PIECE))
        pieces.append(piece)
        left -= len(piece)
        if len(piece) < min(left + len(piece), _READ_PIECE):
            break
    return b"".join(pieces)


def read_record(
    read: Any, path: str, offset: int, verify: bool, limit: int | None = None
) -> bytes | None:
    """The record starting at byte ``offset``, read with ``read(n)``; None at a clean end of file.

    Args:
        read: reads up to ``n`` bytes (fewer only at the end of the file).
        path: the file, for errors.
        offset: where the record starts, for errors.
        verify: check both CRCs.
        limit: the bytes left in the file from ``offset``, where known: a length past it is
            truncation (and is not allocated).

    Raises:
        DataLossError: for a truncated record or a CRC mismatch, naming the file and offset.
    """
    header = read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        if not header:
            return None
        raise truncated(path, offset, f"{len(header)} of its {HEADER_BYTES} header bytes")
    length, length_crc = _HEADER.unpack(header)
    if verify and masked_crc(header[:8]) != length_crc:
        raise corrupt(path, offset, "the length's CRC does not match")
    if length > MAX_RECORD_BYTES or (
        limit is not None and HEADER_BYTES + length + FOOTER_BYTES > limit
    ):
        raise _bad_length(path, offset, length, limit)
    data = read(length) if length <= _READ_PIECE else _read_pieces(read, length)
    footer = read(FOOTER_BYTES)
    if len(data) < length or len(footer) < FOOTER_BYTES:
        got = len(data) + len(footer)
        raise truncated(path, offset, f"{got} of its {length + FOOTER_BYTES} data and CRC bytes")
    if verify and masked_crc(data) != _CRC.unpack(footer)[0]:
        raise corrupt(path, offset, f"the data's CRC does not match ({length} bytes)")
    return data


def truncated(path: str, offset: int, detail: str) -> DataLossError:
    """The error for the record at byte ``offset`` of ``path`` cut short; ``detail`` says how."""
    return DataLossError(f"{path}: truncated record at byte {offset}: {detail}", path, offset)


def corrupt(path: str, offset: int, detail: str) -> DataLossError:
    """The error for the damaged record at byte ``offset`` of ``path``; ``detail`` says how."""
    return DataLossError(f"{path}: corrupt record at byte {offset}: {detail}", path, offset)


def _bad_length(path: str, offset: int, length: int, limit: int | None) -> DataLossError:
    """The error for a record whose ``length`` runs past the ``limit`` bytes left in the file, or
    past :data:`MAX_RECORD_BYTES`."""
    if limit is not None and HEADER_BYTES + length + FOOTER_BYTES > limit:
        return truncated(
            path,
            offset,
            f"it is {length} bytes long, but the file has {limit - HEADER_BYTES} bytes after its "
            "header",
        )
    return corrupt(
        path,
        offset,
        f"its length {length} is above the {MAX_RECORD_BYTES}-byte maximum "
        "(tfrecord_framing.MAX_RECORD_BYTES)",
    )

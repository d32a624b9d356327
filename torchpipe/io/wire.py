"""The protobuf wire format, as far as ``tf.train.Example`` and ``SequenceExample`` need it.

Messages (field numbers from tensorflow/core/example/{example,feature}.proto)::

    Example         { Features features = 1; }
    SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }
    Features        { map<string, Feature> feature = 1; }        // entry: key = 1, value = 2
    FeatureLists    { map<string, FeatureList> feature_list = 1; }
    FeatureList     { repeated Feature feature = 1; }
    Feature         { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1 [packed]; }
    Int64List { repeated int64 value = 1 [packed]; }

Parsing follows protobuf's merge rules: a later map entry with the same key wins, the last
oneof field seen sets a Feature's kind (the same kind twice concatenates), and packed and
unpacked encodings of a list are both read. Unknown fields are skipped.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

BYTES_LIST, FLOAT_LIST, INT64_LIST = 1, 2, 3
KIND_NAMES = {BYTES_LIST: "bytes", FLOAT_LIST: "float", INT64_LIST: "int64"}
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_NUMPY_VARINTS = 24  # from this many bytes of packed varints, numpy decodes them faster
_FLOAT = struct.Struct("<f")
_TWO_64 = 1 << 64


class WireError(ValueError):
    """Bytes that are not a valid message of the expected type."""


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos:]`` (unsigned) and the position after it."""
    try:
        byte = buf[pos]
        if byte < 0x80:
            return byte, pos + 1
        result, shift = byte & 0x7F, 7
        while True:
            pos += 1
            byte = buf[pos]
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result & 0xFFFFFFFFFFFFFFFF, pos + 1
            shift += 7
            if shift > 63:
                raise WireError("a varint is longer than 10 bytes")
    except IndexError:
        raise WireError("the message ends inside a varint") from None


def fields(buf: bytes, start: int, end: int) -> Any:
    """``(field number, wire type, value)`` for each field in ``buf[start:end]``; the value is the
    integer of a VARINT, or the ``(start, end)`` span of a LEN, I32 or I64 field."""
    pos = start
    while pos < end:
        key, pos = read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = read_varint(buf, pos)
            if pos > end:  # the varint's last bytes belong to what follows this message
                raise WireError(f"field {number} runs past the end of its message")
            yield number, wire, value
            continue
        if wire == _LEN:
            length, pos = read_varint(buf, pos)
            span_end = pos + length
        elif wire == _I32:
            span_end = pos + 4
        elif wire == _I64:
            span_end = pos + 8
        else:
            raise WireError(f"unsupported wire type {wire} (field {number})")
        if span_end > end:
            raise WireError(f"field {number} runs past the end of its message")
        yield number, wire, (pos, span_end)
        pos = span_end


def scan_features(buf: bytes, start: int, end: int) -> dict[str, tuple[int, list[Any]]]:
    """A ``Features`` message: feature name -> ``(kind, parts)`` of its Feature, unparsed."""
    found: dict[str, tuple[int, list[Any]]] = {}
    for number, wire, span in fields(buf, start, end):
        if number != 1 or wire != _LEN:
            continue
        key, feature = b"", None
        for entry_number, entry_wire, entry_span in fields(buf, *span):
            if entry_number == 1 and entry_wire == _LEN:
                key = buf[entry_span[0] : entry_span[1]]
            elif entry_number == 2 and entry_wire == _LEN:
                feature = scan_feature(buf, *entry_span)
        found[key.decode("utf-8", "surrogateescape")] = feature if feature is not None else (0, [])
    return found


def scan_feature(buf: bytes, start: int, end: int) -> tuple[int, list[Any]]:
    """A ``Feature`` message: its kind (0 if unset) and the spans of its list message(s)."""
    kind = 0
    parts: list[Any] = []
    for number, wire, span in fields(buf, start, end):
        if wire != _LEN or number not in KIND_NAMES:
            continue
        if number != kind:
            kind, parts = number, []
        parts.append(span)
    return kind, parts


def scan_feature_lists(buf: bytes, start: int, end: int) -> dict[str, list[tuple[int, list[Any]]]]:
    """A ``FeatureLists`` message: name -> the scanned Features of its FeatureList, in order."""
    found: dict[str, list[tuple[int, list[Any]]]] = {}
    for number, wire, span in fields(buf, start, end):
        if number != 1 or wire != _LEN:
            continue
        key, steps = b"", []
        for entry_number, entry_wire, entry_span in fields(buf, *span):
            if entry_number == 1 and entry_wire == _LEN:
                key = buf[entry_span[0] : entry_span[1]]
            elif entry_number == 2 and entry_wire == _LEN:
                steps = [
                    scan_feature(buf, *s)
                    for n, w, s in fields(buf, *entry_span)
                    if n == 1 and w == _LEN
                ]
        found[key.decode("utf-8", "surrogateescape")] = steps
    return found


def message_fields(buf: bytes, wanted: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """The spans of the top-level LEN fields ``wanted`` (the last occurrence of each).

    Protobuf merges repeated occurrences of a message field; records written by TensorFlow
    have one, and a later one replacing an earlier is what readers of such records expect.
    """
    spans: dict[int, tuple[int, int]] = {}
    for number, wire, span in fields(buf, 0, len(buf)):
        if number in wanted and wire == _LEN:
            spans[number] = span
    return spans


# -- list values ---------------------------------------------------------------------------------
def bytes_values(buf: bytes, parts: list[Any]) -> list[bytes]:
    """The values of a ``BytesList``."""
    values = []
    for part in parts:
        for number, wire, span in fields(buf, *part):
            if number == 1 and wire == _LEN:
                values.append(buf[span[0] : span[1]])
    return values


def float_values(buf: bytes, parts: list[Any]) -> np.ndarray:
    """The values of a ``FloatList`` as float32 (packed runs are not copied until concatenated)."""
    runs = []
    for part in parts:
        for number, wire, (s, e) in fields(buf, *part):
            if number != 1 or wire not in (_LEN, _I32):
                continue
            if (e - s) % 4:
                raise WireError("a packed float list's length is not a multiple of 4")
            runs.append(np.frombuffer(buf, "<f4", (e - s) // 4, s))
    if len(runs) == 1:
        return runs[0]
    return np.concatenate(runs) if runs else np.zeros(0, np.float32)


def int64_values(buf: bytes, parts: list[Any]) -> np.ndarray:
    """The values of an ``Int64List`` as int64."""
    runs = []
    for part in parts:
        for number, wire, value in fields(buf, *part):
            if number != 1:
                continue
            if wire == _VARINT:
                runs.append(np.array([value], np.uint64))
            elif wire == _LEN:
                runs.append(decode_varints(buf, *value))
    values = np.concatenate(runs) if runs else np.zeros(0, np.uint64)
    return values.view(np.int64)


def decode_varints(buf: bytes, start: int, end: int) -> np.ndarray:
    """Packed varints in ``buf[start:end]`` as uint64 (int64 bit patterns)."""
    if end - start < _NUMPY_VARINTS:
        values, pos = [], start
        while pos < end:
            value, pos = read_varint(buf, pos)
            values.append(value)
        if pos != end:
            raise WireError("a packed varint runs past the end of its list")
        return np.array(values, np.uint64)
    raw = np.frombuffer(buf, np.uint8, end - start, start)
    last = raw < 0x80  # the final byte of each varint
    if not last[-1]:
        raise WireError("a packed varint runs past the end of its list")
    firsts = np.flatnonzero(np.concatenate(([True], last[:-1])))
    group = np.cumsum(np.concatenate(([0], last[:-1].astype(np.int64))))
    place = np.arange(len(raw)) - firsts[group]
    if place.max() > 9:
        raise WireError("a varint is longer than 10 bytes")
    shifted = (raw & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    return np.bitwise_or.reduceat(shifted, firsts)


# -- writing -------------------------------------------------------------------------------------
def varint(value: int) -> bytes:
    """``value`` as a varint (negative ints as their 64-bit two's complement, 10 bytes)."""
    if value < 0:
        value += _TWO_64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` holding ``payload`` (a LEN field)."""
    return varint((number << 3) | _LEN) + varint(len(payload)) + payload


def feature_message(kind: int, values: Any) -> bytes:
    """A ``Feature`` of ``kind`` holding ``values`` (packed, as TensorFlow writes lists)."""
    if kind == BYTES_LIST:
        body = b"".join(length_delimited(1, v) for v in values)
    elif kind == FLOAT_LIST:
        packed = np.asarray(values, dtype="<f4").tobytes()
        body = length_delimited(1, packed) if packed else b""
    else:
        packed = b"".join(varint(int(v)) for v in values)
        body = length_delimited(1, packed) if packed else b""
    return length_delimited(kind, body)


def map_message(entries: dict[str, bytes]) -> bytes:
    """A map field (number 1) of string keys to encoded messages, keys sorted (deterministic)."""
    return b"".join(
        length_delimited(1, length_delimited(1, key.encode()) + length_delimited(2, value))
        for key, value in sorted(entries.items())
    )

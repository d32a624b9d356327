"""The protobuf wire format of ``torchpipe/io/wire.py`` on its own: varints both ways, the fields
of a message, the scans of Features and FeatureLists with protobuf's merge rules, the list values
(packed and unpacked), the writers read back, and malformed bytes raising ``WireError``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpipe.io import wire
from torchpipe.io.wire import BYTES_LIST, FLOAT_LIST, INT64_LIST, WireError

INT64 = st.integers(-(2**63), 2**63 - 1)


def _key(number: int, wire_type: int) -> bytes:
    return wire.varint((number << 3) | wire_type)


def _feature_parts(feature: bytes) -> tuple[int, list]:
    """The kind and parts of an encoded Feature message."""
    return wire.scan_feature(feature, 0, len(feature))


# -- varints -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, b"\x00"),
        (1, b"\x01"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (300, b"\xac\x02"),
        (2**63, b"\x80" * 9 + b"\x01"),
    ],
)
def test_varint_writes_protobufs_bytes(value, encoded):
    assert wire.varint(value) == encoded
    assert wire.read_varint(encoded, 0) == (value, len(encoded))


def test_a_negative_varint_is_its_64_bit_twos_complement_in_ten_bytes():
    assert wire.varint(-1) == b"\xff" * 9 + b"\x01"
    assert wire.read_varint(wire.varint(-1), 0) == (2**64 - 1, 10)
    assert wire.read_varint(wire.varint(-(2**63)), 0) == (2**63, 10)


def test_read_varint_starts_at_its_position_and_returns_the_position_after():
    buf = b"\x05" + wire.varint(300) + b"\x07"
    assert wire.read_varint(buf, 1) == (300, 3)
    assert wire.read_varint(buf, 3) == (7, 4)


@given(st.integers(0, 2**64 - 1))
def test_an_unsigned_varint_reads_back(value):
    encoded = wire.varint(value)
    assert wire.read_varint(encoded, 0) == (value, len(encoded))


def test_a_message_ending_inside_a_varint_is_a_wire_error():
    for buf in (b"", b"\x80", b"\xff\xff"):
        with pytest.raises(WireError, match="ends inside a varint"):
            wire.read_varint(buf, 0)


def test_a_varint_longer_than_ten_bytes_is_a_wire_error():
    assert wire.read_varint(b"\xff" * 9 + b"\x01", 0)[1] == 10
    with pytest.raises(WireError, match="longer than 10 bytes"):
        wire.read_varint(b"\xff" * 10 + b"\x01", 0)


def test_a_ten_byte_varint_keeps_only_its_low_64_bits():
    assert wire.read_varint(b"\xff" * 9 + b"\x7f", 0) == (2**64 - 1, 10)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


# -- fields --------------------------------------------------------------------------------------
def test_fields_gives_a_varints_value_and_the_span_of_len_i32_and_i64_fields():
    buf = (
        _key(1, 0)
        + wire.varint(150)
        + wire.length_delimited(2, b"abc")
        + _key(3, 5)
        + b"\x01\x02\x03\x04"
        + _key(4, 1)
        + bytes(range(8))
    )
    got = list(wire.fields(buf, 0, len(buf)))
    assert got == [(1, 0, 150), (2, 2, (5, 8)), (3, 5, (9, 13)), (4, 1, (14, 22))]
    assert buf[5:8] == b"abc" and buf[9:13] == b"\x01\x02\x03\x04" and buf[14:22] == bytes(range(8))


def test_fields_reads_only_between_start_and_end():
    inner = wire.varint(8) + wire.varint(7)  # field 1 = 7
    buf = b"\xff\xff" + inner + b"\xff"
    assert list(wire.fields(buf, 2, 2 + len(inner))) == [(1, 0, 7)]
    assert list(wire.fields(buf, 2, 2)) == []


@pytest.mark.parametrize("wire_type", [3, 4, 6, 7])
def test_a_group_or_unknown_wire_type_is_a_wire_error_naming_it(wire_type):
    buf = _key(9, wire_type) + b"\x00"
    with pytest.raises(WireError, match=f"unsupported wire type {wire_type} \\(field 9\\)"):
        list(wire.fields(buf, 0, len(buf)))


@pytest.mark.parametrize(
    "buf",
    [
        wire.varint((2 << 3) | 2) + wire.varint(5) + b"abc",  # LEN
        wire.varint((2 << 3) | 5) + b"abc",  # I32
        wire.varint((2 << 3) | 1) + b"abcdefg",  # I64
    ],
)
def test_a_field_running_past_its_message_is_a_wire_error(buf):
    with pytest.raises(WireError, match="field 2 runs past the end of its message"):
        list(wire.fields(buf, 0, len(buf)))


def test_a_varint_running_past_the_end_of_its_message_is_a_wire_error():
    # The message is the first two bytes; its varint's last byte lies in what follows (the parent).
    buf = _key(1, 0) + b"\x80" + b"\x01"
    with pytest.raises(WireError, match="runs past the end of its message"):
        list(wire.fields(buf, 0, 2))
    with pytest.raises(WireError, match="runs past the end of its message"):
        list(wire.fields(b"\x88\x01\x00", 0, 1))  # the key itself


def test_a_len_field_inside_a_submessage_cannot_reach_past_the_submessage():
    inner = wire.length_delimited(1, b"abcd")
    buf = inner + b"zz"
    with pytest.raises(WireError, match="runs past"):
        list(wire.fields(buf, 0, len(inner) - 1))


# -- messages, features and feature lists --------------------------------------------------------
def test_message_fields_gives_the_last_occurrence_of_each_wanted_len_field():
    buf = (
        wire.length_delimited(1, b"first")
        + wire.length_delimited(2, b"two")
        + wire.length_delimited(1, b"last")
    )
    buf += _key(3, 0) + b"\x01" + wire.length_delimited(4, b"unwanted")
    spans = wire.message_fields(buf, (1, 2, 3))
    assert set(spans) == {1, 2}
    assert buf[slice(*spans[1])] == b"last" and buf[slice(*spans[2])] == b"two"


def test_message_fields_ignores_a_wanted_number_with_another_wire_type():
    buf = _key(1, 0) + b"\x05"
    assert wire.message_fields(buf, (1,)) == {}


def test_feature_message_round_trips_each_kind():
    buf = wire.feature_message(BYTES_LIST, [b"", b"a", b"\x00\xff"])
    kind, parts = _feature_parts(buf)
    assert kind == BYTES_LIST and wire.bytes_values(buf, parts) == [b"", b"a", b"\x00\xff"]

    buf = wire.feature_message(FLOAT_LIST, [1.5, -2.0, 0.1])
    kind, parts = _feature_parts(buf)
    assert kind == FLOAT_LIST
    np.testing.assert_array_equal(wire.float_values(buf, parts), np.float32([1.5, -2.0, 0.1]))

    buf = wire.feature_message(INT64_LIST, [0, -1, 2**63 - 1, -(2**63)])
    kind, parts = _feature_parts(buf)
    assert kind == INT64_LIST
    values = wire.int64_values(buf, parts)
    assert values.dtype == np.int64 and values.tolist() == [0, -1, 2**63 - 1, -(2**63)]


@pytest.mark.parametrize("kind", [BYTES_LIST, FLOAT_LIST, INT64_LIST])
def test_an_empty_list_keeps_its_kind_and_reads_back_empty(kind):
    buf = wire.feature_message(kind, [])
    assert buf == wire.length_delimited(kind, b"")
    got_kind, parts = _feature_parts(buf)
    assert got_kind == kind
    assert (
        len(wire.bytes_values(buf, parts) if kind == BYTES_LIST else wire.float_values(buf, parts))
        == 0
    )
    assert (
        wire.float_values(buf, parts).dtype == np.float32
        and wire.int64_values(buf, parts).dtype == np.int64
    )


@given(st.lists(INT64, max_size=12))
def test_int64_lists_read_back_through_both_packed_decoders(values):
    # Short packed runs are decoded in Python, runs of 24 bytes or more with numpy.
    buf = wire.feature_message(INT64_LIST, values)
    assert wire.int64_values(buf, _feature_parts(buf)[1]).tolist() == values


def test_the_python_and_numpy_varint_decoders_agree():
    values = [0, 1, 127, 128, 300, 2**35, 2**63, 2**64 - 1] * 4
    packed = b"".join(wire.varint(v) for v in values)
    assert len(packed) >= 24
    assert wire.decode_varints(packed, 0, len(packed)).tolist() == values
    short = b"".join(wire.varint(v) for v in values[:4])
    assert len(short) < 24
    assert wire.decode_varints(short, 0, len(short)).tolist() == values[:4]
    assert wire.decode_varints(b"", 0, 0).dtype == np.uint64


@pytest.mark.parametrize("size", [3, 40])  # the Python decoder and the numpy one
def test_a_packed_varint_running_past_its_list_is_a_wire_error(size):
    packed = b"\x01" * (size - 1) + b"\x80"
    buf = packed + b"\x01"  # what follows the list would end the varint
    with pytest.raises(WireError, match="runs past the end of its list"):
        wire.decode_varints(buf, 0, len(packed))


@pytest.mark.parametrize("size", [3, 40])
def test_a_packed_varint_longer_than_ten_bytes_is_a_wire_error(size):
    packed = b"\x01" * (size - 1) + b"\xff" * 10 + b"\x01"
    with pytest.raises(WireError, match="longer than 10 bytes"):
        wire.decode_varints(packed, 0, len(packed))


def test_unpacked_and_packed_int64s_concatenate_in_order():
    body = _key(1, 0) + wire.varint(5) + wire.length_delimited(1, wire.varint(6) + wire.varint(-7))
    body += _key(1, 0) + wire.varint(8) + _key(2, 0) + wire.varint(99)  # field 2: not a value
    buf = wire.length_delimited(INT64_LIST, body)
    assert wire.int64_values(buf, _feature_parts(buf)[1]).tolist() == [5, 6, -7, 8]


def test_unpacked_and_packed_floats_concatenate_in_order():
    body = (
        _key(1, 5)
        + np.float32(1.5).tobytes()
        + wire.length_delimited(1, np.float32([2.5, 3.5]).tobytes())
    )
    buf = wire.length_delimited(FLOAT_LIST, body)
    assert wire.float_values(buf, _feature_parts(buf)[1]).tolist() == [1.5, 2.5, 3.5]


def test_a_packed_float_list_not_a_multiple_of_four_bytes_is_a_wire_error():
    buf = wire.length_delimited(FLOAT_LIST, wire.length_delimited(1, b"\x00" * 6))
    with pytest.raises(WireError, match="multiple of 4"):
        wire.float_values(buf, _feature_parts(buf)[1])


def test_the_last_kind_seen_sets_a_features_kind_and_the_same_kind_twice_concatenates():
    ints, floats = wire.feature_message(INT64_LIST, [1]), wire.feature_message(FLOAT_LIST, [2.0])
    buf = ints + floats
    kind, parts = _feature_parts(buf)
    assert kind == FLOAT_LIST and wire.float_values(buf, parts).tolist() == [2.0]

    buf = ints + wire.feature_message(INT64_LIST, [2, 3])
    kind, parts = _feature_parts(buf)
    assert (
        kind == INT64_LIST
        and len(parts) == 2
        and wire.int64_values(buf, parts).tolist() == [1, 2, 3]
    )

    buf = ints + floats + wire.feature_message(INT64_LIST, [4])  # the float resets the ints
    kind, parts = _feature_parts(buf)
    assert kind == INT64_LIST and wire.int64_values(buf, parts).tolist() == [4]


def test_a_feature_with_no_kind_or_only_unknown_fields_has_kind_zero():
    assert wire.scan_feature(b"", 0, 0) == (0, [])
    # unknown field; a kind number not LEN
    buf = wire.length_delimited(7, b"x") + _key(1, 0) + b"\x01"
    assert _feature_parts(buf) == (0, [])


def test_map_message_sorts_its_keys_and_scan_features_reads_it_back():
    entries = {
        "b": wire.feature_message(INT64_LIST, [2]),
        "a": wire.feature_message(BYTES_LIST, [b"x"]),
    }
    buf = wire.map_message(entries)
    assert buf == wire.map_message(dict(reversed(entries.items())))
    assert buf.index(b"\n\x01a") < buf.index(b"\n\x01b")
    found = wire.scan_features(buf, 0, len(buf))
    assert list(found) == ["a", "b"]
    assert found["a"][0] == BYTES_LIST and wire.bytes_values(buf, found["a"][1]) == [b"x"]
    assert found["b"][0] == INT64_LIST and wire.int64_values(buf, found["b"][1]).tolist() == [2]


def test_a_later_map_entry_with_the_same_key_wins():
    first = wire.map_message({"k": wire.feature_message(INT64_LIST, [1])})
    later = wire.map_message({"k": wire.feature_message(FLOAT_LIST, [2.0])})
    buf = first + later
    kind, parts = wire.scan_features(buf, 0, len(buf))["k"]
    assert kind == FLOAT_LIST and wire.float_values(buf, parts).tolist() == [2.0]


def test_a_map_entry_without_key_or_value_reads_as_the_empty_key_or_an_unset_feature():
    buf = wire.length_delimited(1, wire.length_delimited(1, b"k")) + wire.length_delimited(1, b"")
    assert wire.scan_features(buf, 0, len(buf)) == {"k": (0, []), "": (0, [])}


def test_a_key_that_is_not_utf8_survives_as_surrogates():
    buf = wire.length_delimited(1, wire.length_delimited(1, b"\xff"))
    (key,) = wire.scan_features(buf, 0, len(buf))
    assert key.encode("utf-8", "surrogateescape") == b"\xff"


def test_scan_features_skips_unknown_fields():
    buf = _key(2, 0) + b"\x01" + wire.length_delimited(3, b"junk") + wire.map_message({"k": b""})
    buf += wire.varint((1 << 3) | 5) + b"\x00\x00\x00\x00"  # field 1 with the wrong wire type
    assert wire.scan_features(buf, 0, len(buf)) == {"k": (0, [])}


def test_scan_feature_lists_gives_each_lists_steps_in_order():
    steps = wire.feature_message(INT64_LIST, [1]), wire.feature_message(INT64_LIST, [2, 3])
    feature_list = b"".join(wire.length_delimited(1, s) for s in steps)
    buf = wire.map_message({"seq": feature_list, "empty": b""})
    found = wire.scan_feature_lists(buf, 0, len(buf))
    assert found["empty"] == []
    assert [kind for kind, _ in found["seq"]] == [INT64_LIST, INT64_LIST]
    assert [wire.int64_values(buf, parts).tolist() for _, parts in found["seq"]] == [[1], [2, 3]]


def test_a_truncated_features_message_is_a_wire_error():
    buf = wire.map_message({"k": wire.feature_message(INT64_LIST, [1, 2, 3])})
    for cut in range(1, len(buf)):
        with pytest.raises(WireError):
            wire.scan_features(buf[:cut], 0, cut)

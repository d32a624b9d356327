"""tf.train.Example and SequenceExample: TensorFlow's records parsed to TensorFlow's values and
serialized to TensorFlow's bytes; the seed pipeline of issue #22 against tf.data's output."""

from __future__ import annotations

import io
import json
import os
import random

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp
from tests.fixtures import fixture_data as fd
from torchpipe.io import wire
from torchpipe.testing import assert_checkpoint_roundtrip

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tensorflow")
F32, I64 = torch.float32, torch.int64
SPEC = {
    "float_scalar": tp.io.FixedLenFeature([], F32),
    "float_vector": tp.io.FixedLenFeature([3], F32),
    "int_scalar": tp.io.FixedLenFeature([], I64),
    "int_vector": tp.io.FixedLenFeature([2, 4], I64),
    "bytes_scalar": tp.io.FixedLenFeature([], bytes),
    "bytes_vector": tp.io.FixedLenFeature([3], bytes),
    "varlen_float": tp.io.VarLenFeature(F32),
    "varlen_int": tp.io.VarLenFeature(I64),
    "varlen_bytes": tp.io.VarLenFeature(bytes),
    "empty_float": tp.io.VarLenFeature(F32),
    "optional_int": tp.io.FixedLenFeature([], I64, default_value=-7),
}


def load(name: str):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


def records(name: str) -> list[bytes]:
    return list(tp.TFRecordDataset(os.path.join(FIXTURES, name)))


def plain(value):
    """A parsed value as the fixture JSON holds it (bytes as hex)."""
    if isinstance(value, tp.io.Ragged):
        return {"values": plain(value.values), "row_lengths": value.row_lengths.tolist()}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def test_serialize_example_writes_tensorflows_bytes():
    for i, record in enumerate(records("examples.tfrecord")):
        values = {k: fd.typed(k, v) for k, v in fd.example_features(i).items()}
        assert tp.io.serialize_example(values) == record, i


def test_parse_example_gives_tensorflows_values():
    parsed = tp.io.parse_example(records("examples.tfrecord"), SPEC)
    expected = load("examples_parsed.json")
    assert {k: plain(v) for k, v in parsed.items()} == expected
    assert parsed["int_vector"].dtype == I64 and parsed["int_vector"].shape == (fd.EXAMPLES, 2, 4)
    assert parsed["float_vector"].dtype == F32 and isinstance(parsed["varlen_int"], tp.io.Ragged)


def test_parse_single_example_agrees_with_the_batch():
    batch = tp.io.parse_example(records("examples.tfrecord"), SPEC)
    offsets = {
        k: np.cumsum([0, *batch[k].row_lengths.tolist()])
        for k, s in SPEC.items()
        if isinstance(s, tp.io.VarLenFeature)
    }
    for i, record in enumerate(records("examples.tfrecord")):
        single = tp.io.parse_single_example(record, SPEC)
        for key, value in single.items():
            if key in offsets:
                want = batch[key].values[offsets[key][i] : offsets[key][i + 1]]
                assert plain(value) == plain(want), key
            else:
                assert plain(value) == plain(batch[key][i]), key
    assert single["bytes_scalar"] == b"example-5" and single["float_scalar"].shape == ()


def test_sequence_examples_round_trip_with_tensorflow():
    context_spec = {
        "length": tp.io.FixedLenFeature([], I64),
        "name": tp.io.FixedLenFeature([], bytes),
        "weight": tp.io.FixedLenFeature([], F32),
        "missing": tp.io.FixedLenFeature([], I64, default_value=3),
    }
    sequence_spec = {
        "tokens": tp.io.FixedLenSequenceFeature([], I64),
        "frames": tp.io.FixedLenSequenceFeature([2], F32),
        "words": tp.io.VarLenFeature(bytes),
        "absent": tp.io.FixedLenSequenceFeature([], F32, allow_missing=True),
    }
    tfrecords, parsed = records("sequence_examples.tfrecord"), load("sequence_examples_parsed.json")
    assert len(tfrecords) == len(parsed) > 0
    for i, (record, want) in enumerate(zip(tfrecords, parsed)):
        context, lists = fd.sequence_example(i)
        typed_lists = {k: [fd.typed(k, step) for step in steps] for k, steps in lists.items()}
        assert tp.io.serialize_sequence_example(context, typed_lists) == record
        got_context, got_lists = tp.io.parse_single_sequence_example(
            record, context_spec, sequence_spec
        )
        assert {k: plain(v) for k, v in got_context.items()} == want["context"]
        assert {k: plain(v) for k, v in got_lists.items()} == want["feature_lists"]
        assert got_lists["frames"].shape == (2 + i, 2)
    with pytest.raises(ValueError, match="feature list 'nope' is required but missing"):
        tp.io.parse_single_sequence_example(
            record,
            None,
            {
                "tokens": tp.io.FixedLenSequenceFeature([], I64),
                "nope": tp.io.FixedLenSequenceFeature([], I64),
            },
        )


def test_unpacked_lists_repeated_fields_and_unknown_fields_follow_protobuf():
    # Int64List, one value a field
    unpacked_ints = wire.length_delimited(3, b"\x08\x05\x08" + wire.varint(-2))
    floats = (
        b"\x0d"
        + np.float32(1.5).tobytes()
        + wire.length_delimited(1, np.float32([2.5, 3.5]).tobytes())
    )
    first = wire.length_delimited(
        1,
        wire.length_delimited(1, b"k")
        + wire.length_delimited(2, wire.length_delimited(3, b"\x08\x01")),
    )
    entries = {"ints": unpacked_ints, "floats": wire.length_delimited(2, floats)}
    body = first + wire.map_message(entries) + b"\x18\x07"  # an unknown varint field 3
    parsed = tp.io.parse_single_example(
        wire.length_delimited(1, body) + b"\x10\x01",
        {
            "ints": tp.io.VarLenFeature(I64),
            "floats": tp.io.VarLenFeature(F32),
            "k": tp.io.VarLenFeature(I64),
        },
    )
    assert parsed["ints"].tolist() == [5, -2] and parsed["floats"].tolist() == [1.5, 2.5, 3.5]
    assert parsed["k"].tolist() == [1]
    later = wire.length_delimited(
        1, wire.length_delimited(1, b"k") + wire.length_delimited(2, wire.feature_message(3, [9]))
    )
    assert tp.io.parse_single_example(
        wire.length_delimited(1, first + later), {"k": tp.io.VarLenFeature(I64)}
    )["k"].tolist() == [9]


def test_long_int_lists_decode_exactly():
    rng = random.Random(0)
    for n in (1, 3, 40, 1000):
        values = [
            rng.choice([rng.randrange(-(2**63), 2**63), rng.randrange(0, 300), -1])
            for _ in range(n)
        ]
        parsed = tp.io.parse_single_example(
            tp.io.serialize_example({"v": values}), {"v": tp.io.VarLenFeature(I64)}
        )
        assert parsed["v"].tolist() == values


def test_serialize_accepts_tensors_arrays_and_python_values():
    values = {
        "t": torch.tensor([[1.5, 2.0]]),
        "a": np.arange(3, dtype=np.int32),
        "b": True,
        "s": "h\u00e9",
        "f": 0.25,
        "l": [b"x", "y"],
        "mixed": [1, 2.5],
    }
    spec = {
        "t": tp.io.FixedLenFeature([1, 2], F32),
        "a": tp.io.FixedLenFeature([3], I64),
        "b": tp.io.FixedLenFeature([], I64),
        "s": tp.io.FixedLenFeature([], bytes),
        "f": tp.io.FixedLenFeature([], F32),
        "l": tp.io.FixedLenFeature([2], bytes),
        "mixed": tp.io.VarLenFeature(F32),
    }
    parsed = tp.io.parse_single_example(tp.io.serialize_example(values), spec)
    assert (
        parsed["t"].tolist() == [[1.5, 2.0]]
        and parsed["a"].tolist() == [0, 1, 2]
        and parsed["b"].item() == 1
    )
    assert (
        parsed["s"] == "h\u00e9".encode()
        and parsed["l"] == [b"x", b"y"]
        and parsed["mixed"].tolist() == [1.0, 2.5]
    )


@pytest.mark.parametrize(
    "value, error, message",
    [
        ([], ValueError, "empty list"),
        ({"a": 1}, TypeError, "is a dict"),
        ([2**63], ValueError, "outside int64"),
        ([b"x", 1], TypeError, "mixes"),
        (np.array([1 + 2j]), TypeError, "complex"),
    ],
)
def test_serialize_rejects_values_without_a_kind(value, error, message):
    with pytest.raises(error, match=message):
        tp.io.serialize_example({"k": value})


def test_parse_errors_say_what_and_where():
    record = tp.io.serialize_example({"x": [1.0, 2.0], "n": [3]})
    with pytest.raises(ValueError, match="feature 'y' .* is required but missing"):
        tp.io.parse_single_example(record, {"y": tp.io.FixedLenFeature([], F32)})
    with pytest.raises(ValueError, match=r"feature 'x': 2 values, but shape \[3\] needs 3"):
        tp.io.parse_single_example(record, {"x": tp.io.FixedLenFeature([3], F32)})
    with pytest.raises(ValueError, match="data type float, but the spec asks for int64"):
        tp.io.parse_single_example(record, {"x": tp.io.VarLenFeature(I64)})
    with pytest.raises(ValueError, match="not a serialized tf.train.Example"):
        tp.io.parse_single_example(record[:-3], {"x": tp.io.VarLenFeature(F32)})
    with pytest.raises(ValueError, match="record 1: .*'n'"):
        tp.io.parse_example(
            [record, tp.io.serialize_example({"n": [1, 2]})], {"n": tp.io.FixedLenFeature([], I64)}
        )
    with pytest.raises(TypeError, match="list of serialized records"):
        tp.io.parse_example(record, {"n": tp.io.FixedLenFeature([], I64)})
    with pytest.raises(TypeError, match="expected a serialized record"):
        tp.io.parse_single_example("text", {})
    with pytest.raises(TypeError, match="tp.io.FixedLenFeature or tp.io.VarLenFeature"):
        tp.io.parse_single_example(record, {"x": tp.io.FixedLenSequenceFeature([], F32)})


def test_feature_specs_check_their_arguments():
    with pytest.raises(TypeError, match="dtype must be"):
        tp.io.FixedLenFeature([], torch.float64)
    with pytest.raises(ValueError, match="shape must be"):
        tp.io.FixedLenFeature([-1], F32)
    with pytest.raises(ValueError, match="default_value has 2 values"):
        tp.io.FixedLenFeature([3], F32, default_value=[1.0, 2.0])
    assert tp.io.FixedLenFeature([3], F32, default_value=0.5).default_value == [0.5] * 3
    assert tp.io.FixedLenFeature(2, bytes, default_value="ab").default_value == [b"ab", b"ab"]
    with pytest.raises(TypeError):
        tp.io.VarLenFeature(str)


# -- the seed pipeline of issue #22 against tf.data ------------------------------------------------
SHARD_SPEC = {
    "id": tp.io.FixedLenFeature([], I64),
    "label": tp.io.FixedLenFeature([], I64),
    "image": tp.io.FixedLenFeature([], bytes),
}


def parse_fn(record: bytes):
    parsed = tp.io.parse_single_example(record, SHARD_SPEC)
    with Image.open(io.BytesIO(parsed["image"])) as image:
        pixels = torch.from_numpy(np.array(image.convert("RGB")))
    return pixels[4:12, 4:12, :], parsed["label"], parsed["id"]


def seed_pipeline() -> tp.Dataset:
    files = tp.list_files(os.path.join(FIXTURES, "train-*.tfrecord"))
    ds = files.interleave(tp.TFRecordDataset, cycle_length=3, num_parallel_calls=tp.AUTOTUNE)
    return ds.map(parse_fn, num_parallel_calls=tp.AUTOTUNE).batch(4).prefetch(tp.AUTOTUNE)


def test_seed_pipeline_gives_tf_datas_elements():
    expected = load("shards_tf_data.json")["seed_pipeline"]
    got = list(seed_pipeline())
    assert len(got) == len(expected)
    for (image, label, ident), want in zip(got, expected):
        assert ident.tolist() == want["id"] and label.tolist() == want["label"]
        assert torch.equal(image, torch.tensor(want["image"], dtype=torch.uint8))


def test_tfrecord_dataset_orders_match_tf_data():
    expected = load("shards_tf_data.json")
    paths = [os.path.join(FIXTURES, name) for name in expected["files"]]
    ids = lambda ds: [int(tp.io.parse_single_example(r, SHARD_SPEC)["id"]) for r in ds]  # noqa: E731
    assert ids(tp.TFRecordDataset(paths)) == expected["sequential_ids"]
    assert ids(tp.TFRecordDataset(paths, num_parallel_reads=3)) == expected["parallel_reads_3_ids"]


def test_seed_pipeline_checkpoints():
    assert_checkpoint_roundtrip(seed_pipeline(), positions=[0, 1, 4, 7, 9])

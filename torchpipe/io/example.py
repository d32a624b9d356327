"""``tf.train.Example`` and ``SequenceExample`` without TensorFlow: parsing into tensors and
serializing from Python values (the wire format is in ``wire.py``).

Dtypes are ``torch.float32`` (float_list), ``torch.int64`` (int64_list) and ``bytes``
(bytes_list). A fixed-length feature becomes a tensor of its shape (``bytes``: a ``bytes`` for
shape ``()``, else nested lists); a variable-length one becomes a 1-D tensor (or list of bytes)
for one record, and a :class:`Ragged` ``(values, row_lengths)`` for a batch of records or the
steps of a sequence.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from torchpipe.io import wire
from torchpipe.io.wire import BYTES_LIST, FLOAT_LIST, INT64_LIST, KIND_NAMES

_KINDS = {torch.float32: FLOAT_LIST, torch.int64: INT64_LIST, bytes: BYTES_LIST}
_NUMPY = {FLOAT_LIST: np.float32, INT64_LIST: np.int64}
_INT64_MIN, _INT64_END = -(2**63), 2**63


class Ragged(NamedTuple):
    """Variable-length values of several rows: ``values`` of all rows one after another, and
    how many belong to each row (``row_lengths``, int64). Row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]`` with ``offsets = [0, *row_lengths.cumsum(0)]``."""

    values: Any
    row_lengths: torch.Tensor


def _check_dtype(feature: str, dtype: Any) -> int:
    if dtype not in _KINDS:
        raise TypeError(
            f"{feature}: dtype must be torch.float32, torch.int64 or bytes, got {dtype!r}"
        )
    return _KINDS[dtype]


def _check_shape(feature: str, shape: Any) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    if not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and int(d) >= 0 for d in dims
    ):
        raise ValueError(f"{feature}: shape must be a list of non-negative ints, got {shape!r}")
    return tuple(int(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class FixedLenFeature:
    """A feature with exactly ``prod(shape)`` values, parsed into a tensor of ``shape``.

    Args:
        shape: the value's shape (``[]`` for a scalar).
        dtype: ``torch.float32``, ``torch.int64`` or ``bytes``.
        default_value: used where a record lacks the feature (``prod(shape)`` values or one to
            repeat); without it a missing feature is an error.
    """

    shape: Sequence[int]
    dtype: Any
    default_value: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _check_shape("FixedLenFeature", self.shape))
        kind = _check_dtype("FixedLenFeature", self.dtype)
        if self.default_value is not None:
            object.__setattr__(self, "default_value", _default(self, kind))


def _default(spec: FixedLenFeature, kind: int) -> Any:
    size = math.prod(spec.shape)
    if kind == BYTES_LIST:
        flat = (
            [spec.default_value]
            if isinstance(spec.default_value, (bytes, str))
            else _flatten(spec.default_value)
        )
        flat = [v.encode() if isinstance(v, str) else v for v in flat]
    else:
        flat = np.asarray(spec.default_value, _NUMPY[kind]).ravel().tolist()
    if len(flat) == 1 and size != 1:
        flat = flat * size
    if len(flat) != size:
        raise ValueError(
            f"FixedLenFeature: default_value has {len(flat)} values; shape {list(spec.shape)} needs {size}"
        )
    return flat


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


@dataclasses.dataclass(frozen=True)
class VarLenFeature:
    """A feature with any number of values: a 1-D tensor (list of bytes) for one record, a
    :class:`Ragged` for a batch.

    Args:
        dtype: ``torch.float32``, ``torch.int64`` or ``bytes``.
    """

    dtype: Any

    def __post_init__(self) -> None:
        _check_dtype("VarLenFeature", self.dtype)


@dataclasses.dataclass(frozen=True)
class FixedLenSequenceFeature:
    """A feature list of a SequenceExample whose every step has ``prod(shape)`` values: parsed
    into a tensor ``[steps, *shape]`` (``bytes``: a list of steps).

    Args:
        shape: each step's shape.
        dtype: ``torch.float32``, ``torch.int64`` or ``bytes``.
        allow_missing: a record without the feature list gives zero steps instead of an error.
    """

    shape: Sequence[int]
    dtype: Any
    allow_missing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _check_shape("FixedLenSequenceFeature", self.shape))
        _check_dtype("FixedLenSequenceFeature", self.dtype)


def _check_specs(op: str, features: Any, allowed: tuple[type, ...]) -> dict[str, Any]:
    if features is None:
        return {}
    if not isinstance(features, Mapping):
        raise TypeError(
            f"{op}: features must be a dict of feature name to spec, got {type(features).__name__}"
        )
    for key, spec in features.items():
        if not isinstance(key, str) or not isinstance(spec, allowed):
            names = " or ".join(f"tp.io.{cls.__name__}" for cls in allowed)
            raise TypeError(
                f"{op}: feature {key!r} must map a str to a {names}, got {type(spec).__name__}"
            )
    return dict(features)


def _as_bytes(op: str, serialized: Any) -> bytes:
    if isinstance(serialized, (bytearray, memoryview)):
        return bytes(serialized)
    if not isinstance(serialized, bytes):
        raise TypeError(
            f"{op}: expected a serialized record (bytes), got {type(serialized).__name__}"
        )
    return serialized


# -- values of one feature -------------------------------------------------------------------------
def _values(buf: bytes, found: tuple[int, list[Any]], kind: int, key: str) -> Any:
    """The values of a scanned feature as ``kind`` (an unset Feature has none)."""
    have, parts = found
    if have not in (0, kind):
        raise ValueError(
            f"feature {key!r}: data type {KIND_NAMES[have]}, but the spec asks for {KIND_NAMES[kind]}"
        )
    if kind == BYTES_LIST:
        return wire.bytes_values(buf, parts)
    if kind == FLOAT_LIST:
        return wire.float_values(buf, parts)
    return wire.int64_values(buf, parts)


def _fixed_values(buf: bytes, found: Any, spec: FixedLenFeature, key: str) -> Any:
    """A fixed-length feature's flat values, or its default where it is missing."""
    kind = _KINDS[spec.dtype]
    if found is None:
        if spec.default_value is None:
            raise ValueError(f"feature {key!r} ({KIND_NAMES[kind]}) is required but missing")
        return spec.default_value
    values = _values(buf, found, kind, key)
    size = math.prod(spec.shape)
    if len(values) != size:
        raise ValueError(
            f"feature {key!r}: {len(values)} values, but shape {list(spec.shape)} needs {size}"
        )
    return values


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    """Flat values as nested lists of ``shape`` (a scalar for ``()``)."""
    if not shape:
        return flat[0]
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _tensor(values: Any, kind: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, _NUMPY[kind]).reshape(shape))


def _single(buf: bytes, found: Any, spec: Any, key: str) -> Any:
    kind = _KINDS[spec.dtype]
    if isinstance(spec, VarLenFeature):
        values = [] if found is None else _values(buf, found, kind, key)
        return values if kind == BYTES_LIST else _tensor(values, kind, (len(values),))
    values = _fixed_values(buf, found, spec, key)
    return (
        _nest(list(values), spec.shape) if kind == BYTES_LIST else _tensor(values, kind, spec.shape)
    )


def _scan_example(op: str, buf: bytes) -> dict[str, Any]:
    try:
        spans = wire.message_fields(buf, (1,))
        return wire.scan_features(buf, *spans[1]) if 1 in spans else {}
    except wire.WireError as e:
        raise ValueError(f"{op}: not a serialized tf.train.Example: {e}") from None


def _with_context(op: str, where: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (ValueError, wire.WireError) as e:
        raise ValueError(f"{op}: {where}{e}") from None


# -- public parsing --------------------------------------------------------------------------------
def parse_single_example(serialized: bytes, features: Mapping[str, Any]) -> dict[str, Any]:
    """One ``tf.train.Example`` as a dict of the features named in ``features``.

    Args:
        serialized: the record's bytes.
        features: feature name -> :class:`FixedLenFeature` or :class:`VarLenFeature`.

    Raises:
        TypeError: for a spec or record of the wrong type.
        ValueError: for a record that is not an Example, a missing feature without a default,
            the wrong number of values, or a feature of another data type.
    """
    op = "parse_single_example"
    specs = _check_specs(op, features, (FixedLenFeature, VarLenFeature))
    buf = _as_bytes(op, serialized)
    found = _scan_example(op, buf)
    return {
        key: _with_context(op, "", _single, buf, found.get(key), spec, key)
        for key, spec in specs.items()
    }


def parse_example(serialized: Sequence[bytes], features: Mapping[str, Any]) -> dict[str, Any]:
    """A batch of ``tf.train.Example`` records at once (tf.data's vectorized parsing).

    Fixed-length numeric features are written straight into one ``[batch, *shape]`` tensor;
    variable-length ones become :class:`Ragged`. Use it after ``batch()``:
    ``ds.batch(256).map(lambda records: tp.io.parse_example(records, spec))``.

    Args:
        serialized: a list of records.
        features: as for :func:`parse_single_example`.

    Raises:
        TypeError, ValueError: as :func:`parse_single_example`, naming the record's index.
    """
    op = "parse_example"
    specs = _check_specs(op, features, (FixedLenFeature, VarLenFeature))
    if isinstance(serialized, (bytes, str)) or not isinstance(serialized, Sequence):
        raise TypeError(
            f"{op}: expected a list of serialized records, got {type(serialized).__name__}"
        )
    bufs = [_as_bytes(op, record) for record in serialized]
    scans = [
        _with_context(op, f"record {i}: ", _scan_example, op, buf) for i, buf in enumerate(bufs)
    ]
    return {key: _batched(op, bufs, scans, spec, key) for key, spec in specs.items()}


def _batched(op: str, bufs: list[bytes], scans: list[dict[str, Any]], spec: Any, key: str) -> Any:
    kind = _KINDS[spec.dtype]
    if isinstance(spec, VarLenFeature):
        rows = [
            []
            if s.get(key) is None
            else _with_context(op, f"record {i}: ", _values, b, s[key], kind, key)
            for i, (b, s) in enumerate(zip(bufs, scans))
        ]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        if kind == BYTES_LIST:
            return Ragged([v for r in rows for v in r], lengths)
        flat = np.concatenate(rows) if rows else np.zeros(0)
        return Ragged(torch.from_numpy(flat.astype(_NUMPY[kind])), lengths)
    if kind == BYTES_LIST:
        return [
            _nest(
                list(_with_context(op, f"record {i}: ", _fixed_values, b, s.get(key), spec, key)),
                spec.shape,
            )
            for i, (b, s) in enumerate(zip(bufs, scans))
        ]
    out = np.empty((len(bufs), math.prod(spec.shape)), _NUMPY[kind])
    for i, (buf, scan) in enumerate(zip(bufs, scans)):
        out[i] = _with_context(op, f"record {i}: ", _fixed_values, buf, scan.get(key), spec, key)
    return torch.from_numpy(out.reshape(len(bufs), *spec.shape))


def parse_single_sequence_example(
    serialized: bytes,
    context_features: Mapping[str, Any] | None = None,
    sequence_features: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``tf.train.SequenceExample``: ``(context, feature_lists)`` dicts.

    Args:
        serialized: the record's bytes.
        context_features: name -> :class:`FixedLenFeature` or :class:`VarLenFeature`.
        sequence_features: name -> :class:`FixedLenSequenceFeature` (a ``[steps, *shape]``
            tensor) or :class:`VarLenFeature` (a :class:`Ragged` over the steps).

    Raises:
        TypeError, ValueError: as :func:`parse_single_example`.
    """
    op = "parse_single_sequence_example"
    context_specs = _check_specs(op, context_features, (FixedLenFeature, VarLenFeature))
    sequence_specs = _check_specs(op, sequence_features, (FixedLenSequenceFeature, VarLenFeature))
    buf = _as_bytes(op, serialized)
    try:
        spans = wire.message_fields(buf, (1, 2))
        context = wire.scan_features(buf, *spans[1]) if 1 in spans else {}
        lists = wire.scan_feature_lists(buf, *spans[2]) if 2 in spans else {}
    except wire.WireError as e:
        raise ValueError(f"{op}: not a serialized tf.train.SequenceExample: {e}") from None
    parsed_context = {
        k: _with_context(op, "context ", _single, buf, context.get(k), s, k)
        for k, s in context_specs.items()
    }
    parsed_lists = {
        k: _with_context(op, "feature list ", _steps, buf, lists.get(k), s, k)
        for k, s in sequence_specs.items()
    }
    return parsed_context, parsed_lists


def _steps(buf: bytes, steps: list[Any] | None, spec: Any, key: str) -> Any:
    kind = _KINDS[spec.dtype]
    if steps is None and isinstance(spec, FixedLenSequenceFeature) and not spec.allow_missing:
        raise ValueError(f"{key!r} is required but missing (allow_missing=False)")
    rows = [_values(buf, step, kind, key) for step in steps or []]
    if isinstance(spec, VarLenFeature):
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        if kind == BYTES_LIST:
            return Ragged([v for r in rows for v in r], lengths)
        return Ragged(_tensor(np.concatenate(rows) if rows else [], kind, (-1,)), lengths)
    size = math.prod(spec.shape)
    for t, row in enumerate(rows):
        if len(row) != size:
            raise ValueError(
                f"{key!r}: step {t} has {len(row)} values, but shape {list(spec.shape)} needs {size}"
            )
    if kind == BYTES_LIST:
        return [_nest(list(row), spec.shape) for row in rows]
    return _tensor(np.concatenate(rows) if rows else [], kind, (len(rows), *spec.shape))


# -- serializing -----------------------------------------------------------------------------------
def serialize_example(features: Mapping[str, Any]) -> bytes:
    """A ``tf.train.Example`` holding ``features``, serialized as TensorFlow does with
    ``deterministic=True`` (keys sorted, lists packed).

    Values: float tensors/arrays/floats -> float_list (as float32); integer or bool ones and
    ints -> int64_list; ``bytes`` and ``str`` (UTF-8) -> bytes_list; a list of any one of those.

    Raises:
        TypeError: for a value of another type.
        ValueError: for an empty list (its kind is unknown: pass an empty tensor with a dtype)
            or an int outside int64.
    """
    return wire.length_delimited(1, _features_message("serialize_example", features))


def serialize_sequence_example(
    context: Mapping[str, Any], feature_lists: Mapping[str, Sequence[Any]]
) -> bytes:
    """A ``tf.train.SequenceExample``: ``context`` as for :func:`serialize_example`, and
    ``feature_lists`` mapping each name to its steps (each step a value as in
    :func:`serialize_example`)."""
    op = "serialize_sequence_example"
    if not isinstance(feature_lists, Mapping):
        raise TypeError(f"{op}: feature_lists must be a dict of name to a list of steps")
    lists = {}
    for key, steps in feature_lists.items():
        encoded = [
            wire.feature_message(*_kind_and_values(op, f"{key}[{t}]", s))
            for t, s in enumerate(steps)
        ]
        lists[key] = b"".join(wire.length_delimited(1, feature) for feature in encoded)
    body = wire.length_delimited(1, _features_message(op, context))
    return body + wire.length_delimited(2, wire.map_message(lists))


def _features_message(op: str, features: Any) -> bytes:
    if not isinstance(features, Mapping):
        raise TypeError(
            f"{op}: expected a dict of feature name to values, got {type(features).__name__}"
        )
    for key in features:
        if not isinstance(key, str):
            raise TypeError(f"{op}: feature names must be str, got {key!r}")
    return wire.map_message(
        {key: wire.feature_message(*_kind_and_values(op, key, v)) for key, v in features.items()}
    )


def _kind_and_values(op: str, key: str, value: Any) -> tuple[int, Any]:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return _array_kind(op, key, value)
    if isinstance(value, (bytes, bytearray, str, numbers.Number, np.generic)):
        value = [value]
    if not isinstance(value, Sequence):
        raise TypeError(
            f"{op}: feature {key!r} is a {type(value).__name__}; expected a tensor, array, list, "
            "number, bytes or str"
        )
    if not value:
        raise ValueError(
            f"{op}: feature {key!r} is an empty list, whose kind cannot be inferred; pass an empty "
            "tensor or array with a dtype"
        )
    if all(isinstance(v, (bytes, bytearray, str)) for v in value):
        return BYTES_LIST, [v.encode() if isinstance(v, str) else bytes(v) for v in value]
    if all(isinstance(v, (numbers.Integral, np.integer)) for v in value):
        ints = [int(v) for v in value]
        if not all(_INT64_MIN <= v < _INT64_END for v in ints):
            raise ValueError(f"{op}: feature {key!r} has an int outside int64")
        return INT64_LIST, ints
    if all(isinstance(v, (numbers.Real, np.number)) for v in value):
        return FLOAT_LIST, [float(v) for v in value]
    raise TypeError(f"{op}: feature {key!r} mixes values of different kinds: {value!r:.80}")


def _array_kind(op: str, key: str, array: np.ndarray) -> tuple[int, Any]:
    if array.dtype.kind == "f":
        return FLOAT_LIST, array.ravel()
    if array.dtype.kind in "iub":
        return INT64_LIST, array.ravel().astype(np.int64).tolist()
    if array.dtype.kind in "SO" and all(isinstance(v, (bytes, str)) for v in array.ravel()):
        return BYTES_LIST, [v.encode() if isinstance(v, str) else v for v in array.ravel()]
    raise TypeError(f"{op}: feature {key!r} is an array of {array.dtype}, which no list kind holds")

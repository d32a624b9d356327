"""torch's default_collate a column at a time: the same batches (property-tested) and errors."""

import collections
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data._utils.collate as torch_collate
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from torchpipe.loader.collate import SMALL_ARRAYS, ColumnCollate
from torchpipe.loader.collate import default_collate as column_collate

Point = collections.namedtuple("Point", "x y")
DTYPES = (
    np.float32,
    np.float64,
    np.float16,
    np.int64,
    np.int32,
    np.int16,
    np.uint8,
    np.uint16,
    np.bool_,
    np.complex64,
)
SCALARS = (np.float32, np.float64, np.int64, np.int8, np.bool_)


def _same(a, b):
    """Same type, dtype, shape, values (NaN equal to NaN) and container types, all the way down."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() == b.is_contiguous()
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    # passed through in a list, as torch's (a column torch does not stack)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    else:
        assert a == b or (a != a and b != b)  # NaN passed through


def _outcome(collate, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of a read-only array's tensor
        try:
            return collate(batch), None
        except Exception as e:  # noqa: BLE001 - compared with torch's
            return None, e


def _leaf(kind, shape, dtype):
    """A strategy for one value of a leaf column of ``kind``."""
    if kind == "int":
        return st.integers(-(2**63), 2**63 - 1) | st.integers(2**63, 2**70)
    if kind == "float":
        return st.floats(allow_nan=True, allow_infinity=True)
    if kind == "bool":
        return st.booleans()
    if kind == "str":
        return st.text(max_size=4)
    if kind == "bytes":
        return st.binary(max_size=4)
    if kind == "scalar":
        return st.integers(0, 100).map(SCALARS[dtype % len(SCALARS)])
    np_dtype = np.dtype(DTYPES[dtype % len(DTYPES)])
    array = st.integers(0, 100).map(lambda v: np.full(shape, v, dtype=np_dtype))
    if kind == "array":
        return array
    if kind == "readonly":
        return array.map(lambda a: (a.setflags(write=False), a)[1])
    return array.map(lambda a: torch.from_numpy(a.copy()))  # tensor


LEAVES = ("int", "float", "bool", "str", "bytes", "scalar", "array", "readonly", "tensor")


@st.composite
def _schema(draw, depth=0):
    """A column layout: a leaf (kind, shape, dtype), or a container of layouts; ``mixed`` leaves
    draw another kind, shape or dtype for some elements (a batch torch may refuse, or promote)."""
    if depth >= 2 or draw(st.booleans()):
        kind = draw(st.sampled_from(LEAVES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        return ("leaf", kind, shape, draw(st.integers(0, 9)), draw(st.integers(0, 6)) == 0)
    container = draw(st.sampled_from(("dict", "tuple", "list", "namedtuple")))
    size = 2 if container == "namedtuple" else draw(st.integers(0, 3))
    return (container, [draw(_schema(depth + 1)) for _ in range(size)])


@st.composite
def _element(draw, schema):
    if schema[0] == "leaf":
        _, kind, shape, dtype, mixed = schema
        if mixed and draw(st.booleans()):
            kind, shape, dtype = (
                draw(st.sampled_from(LEAVES)),
                (draw(st.integers(0, 2)),),
                draw(st.integers(0, 9)),
            )
        return draw(_leaf(kind, shape, dtype))
    container, parts = schema
    values = [draw(_element(part)) for part in parts]
    if container == "dict":
        return {f"k{i}": v for i, v in enumerate(values)}
    if container == "namedtuple":
        return Point(*values)
    return tuple(values) if container == "tuple" else values


@st.composite
def _batches(draw):
    schema = draw(_schema())
    return [draw(_element(schema)) for _ in range(draw(st.integers(1, 5)))]


@settings(max_examples=150)
@given(_batches())
def test_it_returns_what_default_collate_returns_or_raises_as_it_does(batch):
    ours, error = _outcome(column_collate, batch)
    theirs, torch_error = _outcome(default_collate, batch)
    assert type(error) is type(torch_error), (error, torch_error)
    if error is None:
        _same(ours, theirs)


def test_dict_rows_of_every_common_kind_collate_as_torch_does():
    rows = [
        {
            "id": f"r{i}",
            "label": i,
            "score": i / 3,
            "ok": i % 2 == 0,
            "features": np.full(16, i, np.float32),
            "image": torch.full((3, 4), float(i)),
            "raw": b"x" * i,
            "n": np.int64(i),
            "meta": {"tags": ["a", "b"], "pair": (i, float(i)), "at": Point(i, -i)},
        }
        for i in range(32)
    ]
    ours = column_collate(rows)
    _same(ours, default_collate(rows))
    # torch's: a nested list's strings come as tuples
    assert isinstance(ours["meta"]["tags"][0], tuple)
    assert ours["id"] == [f"r{i}" for i in range(32)]


def test_large_arrays_and_tensors_are_stacked_by_the_maps_tensor_function():
    stacked = []

    def stack(batch, *, collate_fn_map=None):
        stacked.append(len(batch))
        return torch.stack(batch)

    collate = ColumnCollate(
        {**torch_collate.default_collate_fn_map, torch.Tensor: stack}, stackers=(stack,)
    )
    big = SMALL_ARRAYS // 4  # float32 elements: 4 rows reach it
    rows = [
        (np.full(big, i, np.float32), np.full(2, i, np.float32), torch.ones(2)) for i in range(4)
    ]
    _same(collate(rows), default_collate(rows))
    assert stacked == [4, 4]  # the large arrays' column and the tensors', not the small arrays'


def test_a_map_with_another_tensor_function_gets_it_for_arrays_too():
    seen = []

    def count(batch, *, collate_fn_map=None):
        seen.append(len(batch))
        return torch.stack(batch)

    collate = ColumnCollate({**torch_collate.default_collate_fn_map, torch.Tensor: count})
    collate([np.zeros(2), np.ones(2)])
    assert seen == [2]


def test_changes_to_torchs_default_map_count(monkeypatch):
    monkeypatch.setitem(
        torch_collate.default_collate_fn_map, int, lambda batch, *, collate_fn_map=None: "ints"
    )
    assert (
        column_collate([{"a": 1}, {"a": 2}])
        == {"a": "ints"}
        == default_collate([{"a": 1}, {"a": 2}])
    )


def test_a_batch_of_small_arrays_is_a_resizable_tensor_of_its_own():
    out = column_collate([np.zeros(3, np.float32), np.ones(3, np.float32)])
    out.resize_(10)  # as torch's: memory torch owns, not a numpy array's
    assert out.dtype == torch.float32


def test_uneven_sequences_raise_torchs_error():
    with pytest.raises(RuntimeError, match="equal size"):
        column_collate([(1, 2), (3,)])

"""Columns: many small same-structure elements sent as one stack per tensor component."""

import collections

import pytest
import torch

from tests.runtime.codec.alignment import aligned_base, misaligned
from torchpipe.runtime import codec
from torchpipe.runtime.codec.columns import Columns, to_columns
from torchpipe.testing import assert_elements_equal, assert_same_elements

Record = collections.namedtuple("Record", "x label")


def roundtrip(columns):
    return codec.decode_bytes(codec.encode_bytes(columns))


@pytest.mark.parametrize(
    "make",
    [
        lambda i: torch.full((3,), float(i)),
        lambda i: (torch.full((2, 2), i), i, f"s{i}"),
        lambda i: [torch.full((3,), i, dtype=torch.uint8), float(i)],
        lambda i: Record(torch.arange(4) + i, i % 3),
        lambda i: {"x": torch.full((3,), i), "label": i, "name": b"r"},
    ],
    ids=["tensor", "tuple", "list", "namedtuple", "dict"],
)
def test_elements_come_back_equal_and_of_the_same_types(make):
    values = [make(i) for i in range(5)]
    columns = to_columns(values)
    assert isinstance(columns, Columns)
    rows = roundtrip(columns).rows()
    assert len(rows) == 5
    for got, want in zip(rows, values):
        assert type(got) is type(want)
        assert_elements_equal(got, want)


def test_each_tensor_component_travels_as_one_buffer():
    values = [(torch.full((3,), float(i)), i) for i in range(100)]
    record = codec.encode(to_columns(values))
    assert codec.encode(values).nbytes > record.nbytes
    rows = codec.decode_bytes(codec.encode_bytes(to_columns(values))).rows()
    first = rows[0][0]
    assert (
        first.untyped_storage().data_ptr() == rows[-1][0].untyped_storage().data_ptr()
    )  # rows of one stack


@pytest.mark.parametrize(
    "row",
    [
        torch.ones(3),
        torch.ones(2, 5, dtype=torch.bool),
        torch.tensor(1.5, dtype=torch.float64),
        torch.ones(16),
        torch.ones(17, dtype=torch.int16),
        torch.zeros(0),
    ],
    ids=["12_bytes", "10_bools", "scalar", "64_bytes", "34_bytes", "empty"],
)
def test_rows_start_on_64_byte_boundaries(row):
    values = [{"x": row.clone() if i % 2 else torch.zeros_like(row), "i": i} for i in range(7)]
    record = codec.encode_bytes(to_columns(values))
    for columns in (codec.decode_bytes(record), codec.decode_view(aligned_base(record))):
        rows = columns.rows()
        assert_same_elements(rows, values)
        assert misaligned(rows) == []


@pytest.mark.parametrize(
    "values",
    [
        [torch.zeros(2)],  # one element: nothing to gain
        [torch.zeros(2), torch.zeros(3)],  # shapes differ
        [torch.zeros(2), torch.zeros(2, dtype=torch.float64)],  # dtypes differ
        [torch.zeros(2, requires_grad=True)] * 2,  # needs gradient
        [(torch.zeros(2), 1), [torch.zeros(2), 1]],  # container types differ
        [(1, 2), (1, 2, 3)],  # lengths differ
        [(1, (2, 3)), (1, (2, 3))],  # nested
        [{"a": 1}, {"b": 1}],  # keys differ
        [collections.OrderedDict(a=1)] * 2,  # a dict type rows() would not rebuild
        [1, 2, 3],  # plain leaves: sent as they are
    ],
    ids=[
        "one",
        "shapes",
        "dtypes",
        "grad",
        "types",
        "lengths",
        "nested",
        "keys",
        "ordereddict",
        "ints",
    ],
)
def test_other_elements_are_left_as_they_are(values):
    assert to_columns(values) is None


def test_rows_stack_in_process_when_never_sent():
    values = [(torch.full((2,), float(i)), i) for i in range(3)]
    assert_same_elements(to_columns(values).rows(), values)

"""Many small elements of one shape sent as columns: one stacked tensor per tensor component.

A worker that returns hundreds of small elements at once (an interleave chunk of parsed records)
would otherwise send every tensor as a buffer of its own, each with a reference to pickle, a
slice to cut and a tensor to build on the receiving side. When the elements share one flat
structure (a tensor; a tuple, list or namedtuple of leaves; a dict of leaves with the same keys)
and each tensor component has one shape and dtype, :func:`to_columns` keeps each tensor
component as a :class:`~torchpipe.runtime.codec.records.StackedTensor`, written straight into the record
as one buffer, and every other component as a list. :meth:`Columns.rows` rebuilds the elements;
their tensors are rows (views) of the decoded stacks. Each row is padded to a multiple of 64 bytes
in the record so that every row starts on a 64-byte boundary, like any tensor from a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchpipe import nest
from torchpipe.runtime.codec.pickling import StackedTensor, stackable

_MIN_ROWS = 2


class Columns:
    """Elements of one flat structure, stored component by component.

    Attributes:
        kind: how rows are rebuilt: ``"leaf"`` (each element is the one component), ``"tuple"``,
            ``"list"``, ``"named"`` (``cls(*row)``) or ``"dict"`` (``keys``).
    """

    __slots__ = ("kind", "cls", "keys", "columns")

    def __init__(
        self, kind: str, cls: type | None, keys: list[Any] | None, columns: list[Any]
    ) -> None:
        self.kind, self.cls, self.keys, self.columns = kind, cls, keys, columns

    def rows(self) -> list[Any]:
        """The elements, in order."""
        columns = [_unstack(c) for c in self.columns]
        if self.kind == "leaf":
            return list(columns[0])
        rows = zip(*columns)
        if self.kind == "tuple":
            return list(rows)
        if self.kind == "list":
            return [list(r) for r in rows]
        if self.kind == "named":
            assert self.cls is not None  # "named" columns keep their namedtuple class
            return [self.cls(*r) for r in rows]
        assert self.keys is not None  # "dict" columns keep their keys
        return [dict(zip(self.keys, r)) for r in rows]


def _unstack(column: Any) -> Any:
    if type(column) is StackedTensor:  # never sent: the stack is made here instead
        column = torch.stack(column.parts)
    return column.unbind(0) if type(column) is torch.Tensor else column


def to_columns(values: list[Any]) -> Columns | None:
    """``values`` as :class:`Columns`, or None when they do not share one flat structure with
    same-shape plain tensors (then send them as they are)."""
    if len(values) < _MIN_ROWS:
        return None
    first = values[0]
    cls = type(first)
    if any(type(v) is not cls for v in values):
        return None
    if cls is torch.Tensor:
        stacked = _tensor_column(values)
        return None if stacked is None else Columns("leaf", None, None, [stacked])
    unzipped = _unzip(values, first, cls)
    if unzipped is None:
        return None
    kind, keys, columns = unzipped
    packed = []
    for column in columns:
        if any(nest.is_container(x) for x in column):
            return None
        stacked = _tensor_column(column) if type(column[0]) is torch.Tensor else None
        packed.append(stacked if stacked is not None else list(column))
    return Columns(kind, cls if kind == "named" else None, keys, packed)


def _unzip(
    values: list[Any], first: Any, cls: type
) -> tuple[str, list[Any] | None, list[tuple[Any, ...]]] | None:
    """How elements of type ``cls`` are rebuilt (``kind`` and ``keys``) and their components,
    column by column; None where they are not all one dict's keys or one tuple's length."""
    if isinstance(first, Mapping):
        if cls is not dict:
            return None
        keys = list(first)
        if any(list(v) != keys for v in values):
            return None
        return "dict", keys, list(zip(*(v.values() for v in values)))
    if not isinstance(first, (tuple, list)):
        return None
    size = len(first)
    if any(len(v) != size for v in values):
        return None
    kind = (
        "named"
        if nest.is_namedtuple(first)
        else ("tuple" if cls is tuple else "list" if cls is list else "")
    )
    return (kind, None, list(zip(*values))) if kind else None


def _tensor_column(tensors: Any) -> StackedTensor | None:
    """The column as one stack, when every entry is a plain CPU tensor of the first's shape and
    dtype that needs no gradient."""
    if not stackable(tensors):
        return None
    return StackedTensor(list(tensors), aligned_rows=True, checked=True)

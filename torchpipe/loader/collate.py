"""torch's ``default_collate``, a column at a time: the same batches for a fraction of the Python.

:class:`ColumnCollate` returns exactly what ``torch.utils.data._utils.collate.collate`` returns with
the same ``collate_fn_map`` (``default_collate`` is that with torch's ``default_collate_fn_map``):
the same types, dtypes, shapes, values and containers, and the same exceptions. It walks the first
element's structure once and makes each leaf of the batch with one call: the map's own function
for tensors, Python numbers, numpy scalars, str and bytes (found for a type once, with torch's rule:
the exact type, else the first key it is an instance of), one ``np.stack`` for a column of small
numpy arrays of one dtype and shape (torch makes a tensor of each and stacks those: 32 rows of 16
floats, ~25 us against 4), and a dict, list, tuple or namedtuple rebuilt as torch rebuilds it. A
column it does not know (a container of another type, arrays that differ, anything odd) is torch's:
its subtree goes to torch's ``collate`` with the same input, so a batch that fails fails as torch's.

Used wherever a DataLoader's ``collate_fn`` is torch's ``default_collate`` (loader/fetch.py); a
``collate_fn`` of the user's is never replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.collate as torch_collate

CollateMap = dict[Any, Callable[..., Any]]
"""torch's ``collate_fn_map``: a type (or tuple of types) to ``fn(batch, *, collate_fn_map)``."""

SMALL_ARRAYS = 64 << 10
"""A column of numpy arrays smaller than this in all is stacked by numpy in one call; a larger one
is stacked by the map's tensor function (a worker's goes straight into shared memory)."""

_NUMERIC = frozenset("biufc")
_UNKNOWN = object()


class ColumnCollate:
    """``collate(batch, collate_fn_map=collate_fn_map)`` (torch's), one call a leaf a batch.

    Args:
        collate_fn_map: the map torch's ``collate`` would be given (default: torch's
            ``default_collate_fn_map``, read when called, so that changes to it count).
        stackers: tensor functions of the map (besides torch's ``collate_tensor_fn``) that stack
            same-shape tensors into a tensor of their dtype, so that a column of small arrays may
            be stacked by numpy instead (a map with another tensor function gets torch's path).
    """

    def __init__(
        self, collate_fn_map: CollateMap | None = None, stackers: Sequence[Callable[..., Any]] = ()
    ) -> None:
        self.map = (
            torch_collate.default_collate_fn_map if collate_fn_map is None else collate_fn_map
        )
        self._stackers = (torch_collate.collate_tensor_fn, *stackers)
        self._keys: dict[
            type, Any
        ] = {}  # an element type's key in the map (None: no key), as torch finds it
        self._seen: tuple[Any, ...] = ()  # the map's keys when _keys was filled
        self._fast: dict[Any, Callable[[Sequence[Any], Callable[..., Any]], Any]] = {
            torch_collate.collate_numpy_array_fn: self._arrays,
            torch_collate.collate_int_fn: _numbers,
            torch_collate.collate_float_fn: _numbers,
        }  # torch's function for a leaf -> the same result in fewer calls

    def __call__(self, batch: Sequence[Any]) -> Any:
        keys = tuple(self.map)
        if keys != self._seen:  # a key added or removed: types resolve otherwise
            self._keys.clear()
            self._seen = keys
        return self._column(batch)

    def _column(self, column: Sequence[Any]) -> Any:
        first = column[0]
        kind = type(first)
        key = self._keys.get(kind, _UNKNOWN)
        if key is _UNKNOWN:
            key = self._key_of(kind)
        if key is not None:
            fn = self.map[key]
            fast = self._fast.get(fn)
            return fn(column, collate_fn_map=self.map) if fast is None else fast(column, fn)
        if kind is dict:  # torch copies the first dict and sets each key: a dict, in its key order
            return {name: self._column([d[name] for d in column]) for name in first}
        if kind is list or kind is tuple:
            size = len(first)
            if all(len(e) == size for e in column):  # else torch raises its own error
                return [self._column(part) for part in zip(*column)]  # a list for both, as torch's
        elif (
            isinstance(first, tuple)
            and hasattr(first, "_fields")
            and not isinstance(first, Mapping)
        ):
            # a namedtuple: zip truncates, as torch's
            return kind(*(self._column(part) for part in zip(*column)))
        return torch_collate.collate(column, collate_fn_map=self.map)

    def _key_of(self, kind: type) -> Any:
        """The map's key for elements of ``kind`` (torch's rule: the type itself, else the first
        key it is a subclass of), or None; remembered for the type (a bounded number of them)."""
        key: Any = (
            kind if kind in self.map else next((k for k in self.map if issubclass(kind, k)), None)
        )
        if len(self._keys) < 256:
            self._keys[kind] = key
        return key

    def _arrays(self, column: Sequence[Any], fn: Callable[..., Any]) -> Any:
        """A column of numpy arrays: small ones of one dtype and shape stacked by numpy, larger
        ones by the map's tensor function (torch's collation of their tensors), anything else torch's."""
        first = column[0]
        dtype, shape = first.dtype, first.shape
        same = dtype.kind in _NUMERIC and dtype.isnative
        same = same and all(
            type(a) is np.ndarray and a.dtype == dtype and a.shape == shape for a in column
        )
        stack = self.map.get(torch.Tensor)
        if not same or stack not in self._stackers:
            return fn(column, collate_fn_map=self.map)
        if first.nbytes * len(column) >= SMALL_ARRAYS:
            return stack([torch.from_numpy(a) for a in column], collate_fn_map=self.map)
        # np.array stacks same-shape arrays (a third of np.stack's time on 32 rows); the clone is
        # in memory torch owns (resizable, as torch's)
        return torch.from_numpy(np.array(column, dtype=dtype)).clone()


_NUMBER_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64}
"""What ``torch.tensor`` makes of a list of one Python number type (torch's ``collate_float_fn``
asks float64 itself)."""


def _numbers(column: Sequence[Any], fn: Callable[..., Any]) -> Any:
    """A column of Python numbers of one type, made a tensor through numpy (a fifth of
    ``torch.tensor``'s time on a list); a mix of types, or an int past int64, is torch's ``fn``."""
    kind = type(column[0])
    dtype = _NUMBER_DTYPES.get(kind)
    if dtype is None or not all(type(v) is kind for v in column):
        return fn(column)
    try:
        values: np.ndarray = np.array(column, dtype=dtype)
    except OverflowError:
        return fn(column)  # torch's error
    return torch.from_numpy(values).clone()  # in memory torch owns (resizable, as torch's)


default_collate = ColumnCollate()
"""torch's ``default_collate``, a column at a time (:class:`ColumnCollate` with torch's map)."""

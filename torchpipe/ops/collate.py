"""Collation: how a list of elements becomes one batch (and padded batches).

Collation walks the element structure (tuples, lists, dicts, namedtuples keep their type) and
combines each component across the batch: tensors and numpy arrays are stacked into a tensor,
Python and numpy numbers become a 1-d tensor, strings and bytes are collected into a list.
Pure functions, so worker processes can collate a batch straight into shared memory.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch

from torchpipe import nest

_STRINGS = ("str", "bytes")
_NUMBERS = ("bool", "int", "float")


# -- collation --------------------------------------------------------------------------------
def collate(elements: list) -> Any:
    """Combine a list of elements into one batch, keeping their structure (a pure function).

    Tensors are stacked with ``torch.stack``; numpy arrays and numpy scalars become a tensor of
    their dtype; Python ints, floats and bools become int64, float64 and bool tensors (a mix of
    ints and floats gives float64); str and bytes are collected into a list.

    Raises:
        TypeError: for a component of another type (None, images, objects), naming its path.
        ValueError: if the elements differ in structure, or a component in shape or dtype.
    """
    if not isinstance(elements, list) or not elements:
        raise ValueError("collate: expected a non-empty list of elements")
    return collate_in_stage(elements, "collate")


def collate_in_stage(elements: list, stage: str, stack: Callable[[list], Any] = torch.stack) -> Any:
    """:func:`collate` with errors naming ``stage``.

    Args:
        stack: combines the same-shape tensors of one component; worker processes pass
            ``codec.StackedTensor`` so the stacking happens straight into shared memory.
    """
    return _walk(
        elements,
        "element",
        stage,
        lambda values, path, shape, pad: _collate_leaf(values, path, stage, stack),
    )


def _walk(
    values: list, path: str | _Child, stage: str, leaf: Callable, shape: Any = None, pad: Any = None
) -> Any:
    """Rebuild the elements' common structure with ``leaf(values, path, shape, pad)`` per component
    (``path`` names it in errors: a str, or a dict value's :class:`_Child`, formatted as one).

    ``shape`` and ``pad`` are the parts of ``padded_shapes`` and ``padding_values`` that apply
    to this subtree (``None``: not given; a non-container pad value applies to every leaf).
    """
    first = values[0]
    if not nest.is_container(first):
        return leaf(values, path, shape, pad)
    # dict rows, the common case: no specs
    if type(first) is dict and shape is None and pad is None:
        return {
            key: _walk(column, _Child(path, key), stage, leaf)
            for key, column in _dict_columns(values, path, stage).items()
        }
    _check_same_container(values, path, stage)
    columns = (
        zip(*values)
        if isinstance(first, (tuple, list))
        else zip(*(nest.children(v) for v in values))
    )
    shapes = _spec_children(shape, first, path, stage, "padded_shapes", broadcast=False)
    pads = _spec_children(pad, first, path, stage, "padding_values", broadcast=True)
    parts = zip(columns, child_paths(first, path), shapes, pads)
    return nest.rebuild(first, [_walk(list(c), p, stage, leaf, s, q) for c, p, s, q in parts])


_DICT = {dict}


def _dict_columns(values: list, path: str | _Child, stage: str) -> dict[Any, list]:
    """Each key's values across dict rows (taken by key: rows may list their keys in any order).

    Rows of one size that all hold the first row's keys hold the same keys: a missing one is a
    KeyError, and then :func:`_check_same_container` names what differs."""
    if set(map(type, values)) != _DICT or len(set(map(len, values))) != 1:
        _check_same_container(values, path, stage)  # raises: not all dicts, or sizes differ
    try:
        return {key: [v[key] for v in values] for key in values[0]}
    except KeyError:
        _check_same_container(values, path, stage)  # raises: the keys differ
        raise


class _Child:
    """The path of a dict's value, formatted only when an error names it."""

    __slots__ = ("parent", "key")

    def __init__(self, parent: Any, key: Any) -> None:
        self.parent, self.key = parent, key

    def __str__(self) -> str:
        return f"{self.parent}[{self.key!r}]"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def child_paths(container: Any, path: str | _Child) -> list[Any]:
    """The paths of ``container``'s children (formatted only when an error names one)."""
    if nest.is_namedtuple(container):
        return [f"{path}.{field}" for field in type(container)._fields]
    keys = container.keys() if isinstance(container, Mapping) else range(len(container))
    return [_Child(path, key) for key in keys]


def _check_same_container(values: list, path: str | _Child, stage: str) -> None:
    first = values[0]
    kind, size = type(first), len(first)
    if kind is dict:
        keys = list(first)
        if all(type(v) is dict and list(v) == keys for v in values):
            return  # the common case of dict rows, checked in one pass
    elif not isinstance(first, Mapping) and all(type(v) is kind and len(v) == size for v in values):
        return  # the common case, checked in one pass
    for v in values[1:]:
        same = type(v) is type(first) and len(v) == len(first)
        if same and isinstance(first, Mapping) and list(v.keys()) != list(first.keys()):
            raise ValueError(
                f"{stage}: elements differ in keys at {path}: {list(first)} vs {list(v)}"
            )
        if not same:
            raise ValueError(
                f"{stage}: elements differ in structure at {path}: "
                f"{type(first).__name__} of length {len(first)} vs {_describe(v)}"
            )


def _describe(x: Any) -> str:
    return (
        f"{type(x).__name__} of length {len(x)}"
        if nest.is_container(x)
        else f"a {type(x).__name__}"
    )


def _spec_children(
    spec: Any, first: Any, path: str | _Child, stage: str, name: str, broadcast: bool
) -> list[Any]:
    """The parts of ``spec`` (padded_shapes or padding_values) for each child of ``first``."""
    if spec is None or (broadcast and not nest.is_container(spec)):
        return [spec] * len(first)
    if isinstance(first, Mapping):
        if isinstance(spec, Mapping) and set(spec.keys()) == set(first.keys()):
            return [spec[key] for key in first]
    elif nest.is_container(spec) and not isinstance(spec, Mapping) and len(spec) == len(first):
        return list(spec)
    raise ValueError(
        f"{stage}: {name} does not match the element's structure at {path}: got {spec!r}"
    )


_KINDS = (
    (str, "str"),
    (bytes, "bytes"),
    (torch.Tensor, "tensor"),
    ((np.ndarray, np.generic), "numpy"),
    (bool, "bool"),
    (int, "int"),
    (float, "float"),
)


_KIND_OF_TYPE: dict[type, str | None] = {}  # _kind by exact type, filled as types are seen


def _kind(value: Any) -> str | None:
    """The collation kind of a leaf, or None when it cannot be batched."""
    return next((kind for types, kind in _KINDS if isinstance(value, types)), None)


def _common_kind(values: list, path: str, stage: str) -> str:
    types = set(map(type, values))
    if len(types) == 1:
        kind = _KIND_OF_TYPE.get(types.pop(), "")
        if kind:
            return kind
    kinds = {_kind(v) for v in values}
    if len(kinds) == 1 and None not in kinds and len(_KIND_OF_TYPE) < 256:
        _KIND_OF_TYPE[type(values[0])] = next(iter(kinds))
    if any(nest.is_container(v) for v in values):
        raise ValueError(
            f"{stage}: elements differ in structure at {path}: some are containers, some are not"
        )
    if None in kinds:
        bad = next(v for v in values if _kind(v) is None)
        raise TypeError(
            f"{stage}: cannot batch {path} of type {type(bad).__name__}; convert it to a tensor, array, "
            "number or str with map(), or pass batch(collate_fn=...)"
        )
    names = cast("set[str]", kinds)  # None is not among them
    if names == {"int", "float"}:
        return "float"
    if len(names) > 1:
        raise ValueError(f"{stage}: {path} mixes types {sorted(names)} across the batch")
    return names.pop()


_NUMBER_DTYPES = {"bool": np.bool_, "int": np.int64, "float": np.float64}


def _numbers_tensor(values: list, kind: str, path: str, stage: str) -> torch.Tensor:
    """Python numbers (bools, ints, floats; ints and floats mixed as float) as one tensor, made
    through numpy (a third of ``torch.tensor``'s time on a list of 32)."""
    try:
        return torch.from_numpy(np.array(values, dtype=_NUMBER_DTYPES[kind]))
    except (OverflowError, ValueError, TypeError) as e:
        dtype = {"bool": torch.bool, "int": torch.int64, "float": torch.float64}[kind]
        raise ValueError(f"{stage}: {path} does not fit in {dtype}: {e}") from e


def _as_tensors(values: list, kind: str, path: str, stage: str) -> list[torch.Tensor]:
    """Tensors (zero-copy for numpy) of one component, all of the same dtype."""
    if kind == "numpy":
        arrays = [np.asarray(v) for v in values]
        bad = next((a for a in arrays if a.dtype.kind not in "biufc"), None)
        if bad is not None:
            raise TypeError(
                f"{stage}: cannot batch {path}: numpy dtype {bad.dtype} has no tensor equivalent; convert it with map()"
            )
        # A read-only array (Ray's rows, a memory map) is copied: torch warns of, and does not
        # support, tensors over memory it may not write.
        values = [torch.from_numpy(a if a.flags.writeable else a.copy()) for a in arrays]
    dtypes = {t.dtype for t in values}
    if len(dtypes) > 1:
        raise ValueError(
            f"{stage}: {path} has different dtypes across the batch: {sorted(map(str, dtypes))}"
        )
    return values


SMALL_ARRAYS = 64 << 10
"""A component of numpy arrays smaller than this in all is stacked by numpy at once."""


def _stack_small_arrays(values: list) -> torch.Tensor | None:
    """Small numpy arrays of one dtype and shape stacked by numpy in one call (a tensor view of
    each and ``torch.stack`` cost more than the copy: 32 rows of 29 floats, 12 us against 4);
    None for anything else (the general path takes it, and names what differs)."""
    first = values[0]  # an array or a numpy scalar: both have a dtype and nbytes
    dtype = first.dtype
    if first.nbytes * len(values) >= SMALL_ARRAYS or dtype.kind not in "biufc":
        return None
    if len({v.dtype for v in values}) > 1:
        return None
    try:  # np.array of same-shape arrays stacks them (a third of np.stack's time on 32 rows)
        return torch.from_numpy(np.array(values, dtype=dtype))
    except ValueError:  # shapes differ
        return None


def _collate_leaf(values: list, path: str, stage: str, stack: Callable[[list], Any]) -> Any:
    kind = _common_kind(values, path, stage)
    if kind in _STRINGS:
        return list(values)
    if kind in _NUMBERS:
        return _numbers_tensor(values, kind, path, stage)
    if kind == "numpy":
        small = _stack_small_arrays(values)
        if small is not None:
            return small
    tensors = _as_tensors(values, kind, path, stage)
    try:
        return stack(tensors)  # checks the shapes itself
    except (RuntimeError, ValueError):
        shape = tensors[0].shape
        bad = next((t for t in tensors if t.shape != shape), None)
        if bad is None:
            raise
        raise ValueError(
            f"{stage}: {path} has different shapes in one batch: {tuple(shape)} and {tuple(bad.shape)}; "
            "use padded_batch() to pad them"
        ) from None


# -- padded collation -------------------------------------------------------------------------
def padded_collate(
    elements: list, stage: str, shapes: Any, pads: Any, boundary: int | None = None
) -> Any:
    """Collate ``elements``, padding tensor components to a common shape.

    Args:
        shapes: ``padded_shapes`` (None: pad every dimension to the batch maximum).
        pads: ``padding_values`` (None: 0).
        boundary: with ``pad_to_bucket_boundary``, the size that unknown dimensions get.
    """

    def leaf(values: list, path: str, shape: Any, pad: Any) -> Any:
        return _padded_leaf(values, path, stage, shape, pad, boundary, explicit=shapes is not None)

    return _walk(elements, "element", stage, leaf, shapes, pads)


def _padded_leaf(
    values: list, path: str, stage: str, shape: Any, pad: Any, boundary: int | None, explicit: bool
) -> Any:
    kind = _common_kind(values, path, stage)
    if kind in _STRINGS:
        return list(values)
    if kind in _NUMBERS:
        _target_dims(shape, 0, None, explicit, path, stage)
        return _numbers_tensor(values, kind, path, stage)
    tensors = _as_tensors(values, kind, path, stage)
    ranks = {t.dim() for t in tensors}
    if len(ranks) > 1:
        raise ValueError(f"{stage}: {path} has different ranks in one batch: {sorted(ranks)}")
    dims = _target_dims(shape, tensors[0].dim(), boundary, explicit, path, stage)
    target = [
        max(t.shape[d] for t in tensors) if want is None else want for d, want in enumerate(dims)
    ]
    for t in tensors:
        if any(have > want for have, want in zip(t.shape, target)):
            raise ValueError(
                f"{stage}: {path} has shape {tuple(t.shape)}, larger than its padded shape {tuple(target)}"
            )
    value = _fill_value(pad, tensors[0].dtype, path, stage)
    if all(list(t.shape) == target for t in tensors):
        return torch.stack(tensors)
    out = torch.full((len(tensors), *target), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        index: tuple[int | slice, ...] = (i, *(slice(0, n) for n in t.shape))
        out[index] = t
    return out


def _target_dims(
    shape: Any, rank: int, boundary: int | None, explicit: bool, path: str, stage: str
) -> list[Any]:
    """Each dimension's padded size (None: the batch maximum)."""
    if shape is None:
        # Without padded_shapes the sequence dimension (0) is the unknown one tf would fill.
        if explicit or boundary is None or rank == 0:
            return [None] * rank
        return [boundary] + [None] * (rank - 1)
    if not isinstance(shape, (list, tuple)):
        raise ValueError(
            f"{stage}: padded_shapes for {path} must be a list of dimensions, got {shape!r}"
        )
    if len(shape) != rank:
        raise ValueError(
            f"{stage}: padded_shapes for {path} is {list(shape)} (rank {len(shape)}), but the component has rank {rank}"
        )
    return [boundary if d is None or d == -1 else int(d) for d in shape]


def _fill_value(pad: Any, dtype: torch.dtype, path: str, stage: str) -> Any:
    """The padding value as a Python scalar that ``dtype`` represents exactly."""
    if pad is None:
        return 0
    scalar = pad.item() if isinstance(pad, (torch.Tensor, np.ndarray, np.generic)) else pad
    if not isinstance(scalar, (bool, int, float)):
        raise TypeError(
            f"{stage}: padding value for {path} must be a number, got {type(pad).__name__} {pad!r}"
        )
    if not (dtype.is_floating_point or dtype.is_complex):
        try:
            probe = torch.tensor(scalar)
            fits = probe.to(dtype).to(probe.dtype).item() == scalar
        except (RuntimeError, OverflowError, ValueError):
            fits = False
        if not fits:
            raise ValueError(
                f"{stage}: padding value {scalar!r} for {path} does not fit its dtype {dtype}"
            )
    return scalar


def check_padding_values_fit(element: Any, stage: str, pads: Any) -> None:
    """Raise if ``padding_values`` cannot pad ``element``, the first of a pass, before any batch.

    The structure must match (as :func:`padded_collate` reads it), a str or bytes cannot pad a
    number, tensor or array, and a number must fit a tensor's or array's dtype. A str or bytes
    component is collected into a list, never padded, so any padding value passes for it.

    Raises:
        ValueError: for another structure, or a number the component's dtype cannot hold.
        TypeError: for a str or bytes padding value of a numeric component.
    """
    if pads is None:
        return

    def leaf(values: list, path: str, shape: Any, pad: Any) -> None:
        _check_pad_fits(values[0], path, stage, pad)

    _walk([element], "element", stage, leaf, None, pads)


def _check_pad_fits(value: Any, path: str, stage: str, pad: Any) -> None:
    kind = _kind(value)
    if pad is None or kind in (None, *_STRINGS):
        return  # strings are not padded; other types fail in collation, as in batch()
    tensor = _as_tensors([value], kind, path, stage)[0] if kind in ("tensor", "numpy") else None
    if isinstance(pad, (str, bytes)):
        raise TypeError(
            f"{stage}: padding_values for {path} (a {_leaf_name(value, kind)}) expected a number, "
            f"got {type(pad).__name__} {pad!r}"
        )
    if tensor is not None:
        _fill_value(pad, tensor.dtype, path, stage)


def _leaf_name(value: Any, kind: str) -> str:
    if kind == "tensor":
        return f"tensor of dtype {value.dtype}"
    if kind == "numpy":
        return f"numpy value of dtype {np.asarray(value).dtype}"
    return f"Python {kind}"


def check_padded_shapes(op: str, shapes: Any) -> None:
    for dim in nest.flatten(shapes):
        if dim is None:
            continue
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"{op}: padded_shapes dimensions must be ints, -1 or None, got {dim!r}")
        if dim < -1:
            raise ValueError(f"{op}: padded_shapes dimensions must be >= -1, got {dim}")


_PAD_TYPES = (bool, int, float, str, bytes, np.generic, torch.Tensor, np.ndarray)


def check_padding_values(op: str, values: Any) -> None:
    """Raise at the call for padding values that could pad nothing.

    What pads depends on the elements, which the call cannot see: :func:`check_padding_values_fit`
    checks that at a pass's first element.

    Raises:
        TypeError: for a padding value that is not a number, bool, str, bytes, 0-d tensor or
            array, or None (alone or in a tuple, list or dict).
        ValueError: for a tensor or array that is not 0-d.
    """
    for value in nest.flatten(values):
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim != 0:
            raise ValueError(
                f"{op}: padding_values expected scalars, got a tensor of shape {tuple(value.shape)}"
            )
        if value is not None and not isinstance(value, _PAD_TYPES):
            raise TypeError(
                f"{op}: padding_values expected numbers (str or bytes for string components), "
                "0-d tensors or arrays, or None, alone or in a structure, "
                f"got {type(value).__name__}"
            )

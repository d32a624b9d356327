"""Nested structures of elements: tuples, lists, dicts and namedtuples over leaves.

An element is any nesting of those containers; everything else (tensors, arrays, numbers,
strings, bytes, None, arbitrary objects) is a leaf. Containers keep their exact type when
rebuilt, so a namedtuple stays that namedtuple and a dict keeps its key order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


def is_namedtuple(x: Any) -> bool:
    """Whether ``x`` is an instance of a ``collections.namedtuple`` / ``typing.NamedTuple``."""
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


_LEAVES = frozenset((int, float, bool, str, bytes, type(None)))  # common leaves, told apart at once


def is_container(x: Any, lists: bool = True) -> bool:
    """Whether ``x`` is a structure node (tuple, list, dict or namedtuple) rather than a leaf.

    With ``lists=False`` a list counts as a leaf (``from_tensor_slices`` slices lists as data).
    """
    kind = type(x)
    if kind is dict or kind is tuple:  # the usual ones first: Mapping's isinstance is slow
        return True
    if kind in _LEAVES:
        return False
    return isinstance(x, (tuple, Mapping)) or (lists and isinstance(x, list))


def rebuild(template: Any, children: list[Any]) -> Any:
    """A container of ``template``'s type (and keys) holding ``children`` in order."""
    if isinstance(template, Mapping):
        return _rebuild_mapping(template, children)
    if is_namedtuple(template):
        return type(template)(*children)
    if isinstance(template, tuple):
        return tuple(children) if type(template) is tuple else type(template)(children)
    return children if type(template) is list else type(template)(children)


def _rebuild_mapping(template: Mapping, children: list[Any]) -> Mapping:
    pairs = zip(template.keys(), children)
    if type(template) is dict:
        return dict(pairs)
    try:
        return type(template)(pairs)  # type: ignore[call-arg]  # a TypeError falls back to dict
    except TypeError:
        return dict(pairs)


def children(x: Any) -> list[Any]:
    """The direct children of a container, in order (a dict's values in key order)."""
    if type(x) is dict:
        return list(x.values())
    return list(x.values()) if isinstance(x, Mapping) else list(x)


def flatten(structure: Any, lists: bool = True) -> list[Any]:
    """The leaves of ``structure`` in depth-first order (``lists``: see :func:`is_container`)."""
    if not is_container(structure, lists):
        return [structure]
    leaves: list[Any] = []
    for child in children(structure):
        leaves.extend(flatten(child, lists))
    return leaves


def pack_as(template: Any, leaves: list[Any], lists: bool = True) -> Any:
    """Rebuild ``template``'s structure with ``leaves`` (inverse of :func:`flatten`)."""
    it = iter(leaves)
    out = _pack(template, it, lists)
    if next(it, _END) is not _END:
        raise ValueError("more leaves than the structure has places for")
    return out


_END = object()


def _pack(template: Any, it: Iterator[Any], lists: bool) -> Any:
    if not is_container(template, lists):
        try:
            return next(it)
        except StopIteration:
            raise ValueError("fewer leaves than the structure has places for") from None
    return rebuild(template, [_pack(c, it, lists) for c in children(template)])


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``fn`` to the corresponding leaves of structures that have the same shape.

    Raises:
        ValueError: if the structures differ in type, length or keys.
    """
    first = structures[0]
    if not is_container(first):
        return fn(*structures)
    for other in structures[1:]:
        assert_same_structure(first, other)
    parts = zip(*(children(s) for s in structures))
    return rebuild(first, [map_structure(fn, *p) for p in parts])


def assert_same_structure(a: Any, b: Any) -> None:
    """Raise ValueError unless ``a`` and ``b`` nest the same containers the same way."""
    if is_container(a) != is_container(b):
        raise ValueError(f"structures differ: {_describe(a)} vs {_describe(b)}")
    if not is_container(a):
        return
    if type(a) is not type(b):
        raise ValueError(f"structures differ: {_describe(a)} vs {_describe(b)}")
    if isinstance(a, Mapping) and list(a.keys()) != list(b.keys()):
        raise ValueError(f"dict keys differ: {list(a.keys())} vs {list(b.keys())}")
    if len(a) != len(b):
        raise ValueError(f"structures differ in length: {len(a)} vs {len(b)}")
    for ca, cb in zip(children(a), children(b)):
        assert_same_structure(ca, cb)


def _describe(x: Any) -> str:
    if isinstance(x, Mapping):
        return f"dict with keys {list(x.keys())}"
    if is_container(x):
        return f"{type(x).__name__} of length {len(x)}"
    return f"leaf of type {type(x).__name__}"

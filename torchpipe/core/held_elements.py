"""What the elements an op keeps in its checkpoint have in common, to refuse a damaged state.

A shuffle buffer or a partial bucket is part of a state; a state whose elements were swapped for
others (a string for a tensor, a dict for a tuple) would load and fail much later, in a batch
downstream. An op that holds elements records their *structure* as they arrive: container types
and keys, leaf types, a tensor's or array's dtype and rank (never shapes or values, which vary
legitimately). Two structures merge into what they share (a part that differs becomes a
wildcard), so the recorded structure fits every element that arrived: a state the op made always
loads, however its elements vary, and a held element that does not fit it is a CheckpointError.

A structure is plain data (tuples of str, int and None) so that ``torch.load(weights_only=True)``
reads it:

- ``ANY``: anything; ``("tensor", dtype, ndim)``, ``("ndarray", dtype, ndim)``: ``None`` where
  elements differ; ``("leaf", type name)``;
- ``(container, keys, items)``: ``container`` is ``"tuple"``, ``"list"``, ``"dict"`` or a
  namedtuple's type name; ``keys`` a dict's keys or a sequence's length, ``items`` the children's
  structures; both ``None`` where elements differ (a list longer than ``MAX_ITEMS`` is not
  looked into).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from torchpipe import nest
from torchpipe.errors import CheckpointError

ANY = "any"
MAX_ITEMS = 64
_NAMES: dict[Any, str] = {}  # type and torch dtype names, by the object


def _name(key: Any) -> str:
    name = _NAMES.get(key)
    if name is None:
        if isinstance(key, torch.dtype):
            name = str(key).removeprefix("torch.")
        else:
            name = (
                key.__qualname__
                if key.__module__ == "builtins"
                else f"{key.__module__}.{key.__qualname__}"
            )
        _NAMES[key] = name
    return name


def _container(x: Any) -> str:
    if nest.is_namedtuple(x):
        return _name(type(x))
    return "dict" if isinstance(x, Mapping) else "list" if isinstance(x, list) else "tuple"


def structure(x: Any) -> Any:
    """The structure of one element."""
    if isinstance(x, torch.Tensor):
        return ("tensor", _name(x.dtype), x.dim())
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.ndim)
    if not nest.is_container(x):
        return ("leaf", _name(type(x)))
    if isinstance(x, Mapping):
        return ("dict", tuple(x), tuple(structure(v) for v in x.values()))
    if isinstance(x, list) and len(x) > MAX_ITEMS:
        return ("list", len(x), None)
    return (_container(x), len(x), tuple(structure(v) for v in x))


def merge(a: Any, b: Any) -> Any:
    """What structures ``a`` and ``b`` share (``None`` stands for no element yet)."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    if a == ANY or b == ANY or a[0] != b[0] or a[0] == "leaf":
        return ANY
    if a[0] in ("tensor", "ndarray"):
        return (a[0], a[1] if a[1] == b[1] else None, a[2] if a[2] == b[2] else None)
    if a[1] != b[1] or a[2] is None or b[2] is None:
        return (a[0], None, None)
    return (a[0], a[1], tuple(merge(x, y) for x, y in zip(a[2], b[2])))


def fits(x: Any, s: Any) -> bool:
    """Whether element ``x`` has structure ``s`` (wildcards fit anything)."""
    if s == ANY:
        return True
    kind = s[0]
    if kind == "tensor":
        return (
            isinstance(x, torch.Tensor)
            and s[1] in (None, _name(x.dtype))
            and s[2] in (None, x.dim())
        )
    if kind == "ndarray":
        return isinstance(x, np.ndarray) and s[1] in (None, x.dtype.str) and s[2] in (None, x.ndim)
    if kind == "leaf":
        return _name(type(x)) == s[1]  # a tensor, an array or a container is never a "leaf"
    if not nest.is_container(x) or _container(x) != kind:
        return False
    keys = tuple(x) if isinstance(x, Mapping) else len(x)
    if s[1] is not None and keys != s[1]:
        return False
    if s[2] is None:
        return True
    children = x.values() if isinstance(x, Mapping) else x
    return all(fits(c, t) for c, t in zip(children, s[2]))


def describe_structure(s: Any) -> str:
    """A structure as text, for errors."""
    if s == ANY or s is None:
        return "anything"
    if s[0] in ("tensor", "ndarray"):
        return f"{s[0]}({s[1] or 'any dtype'}, {'any rank' if s[2] is None else f'{s[2]}-d'})"
    if s[0] == "leaf":
        return s[1]
    if s[2] is None:
        return f"{s[0]}(...)"
    if s[0] == "dict":
        return "{" + ", ".join(f"{k!r}: {describe_structure(t)}" for k, t in zip(s[1], s[2])) + "}"
    return f"{s[0]}({', '.join(describe_structure(t) for t in s[2])})"


class HeldStructure:
    """The merged structure of the elements an op holds, worked out when a state is taken.

    Elements are looked at when a state is taken, not as they arrive, so an op that is never
    checkpointed pays nothing: those that arrived since the last state (up to ``FRESH``, kept by
    reference), or else everything the op holds. An op checkpointed after every element (an
    asynchronous op's input is) looks at one element each time.
    """

    FRESH = 64

    def __init__(self) -> None:
        self.structure: Any = None  # None: no element yet
        self._fresh: list[Any] = []
        self._stale = False  # more than FRESH arrived since the last state

    def fill(self, buffer: Any, source: Any, capacity: int) -> bool:
        """Pull elements of ``source`` into ``buffer`` (noting each) until it holds ``capacity``;
        returns whether ``source`` ended."""
        while len(buffer) < capacity:
            try:
                element = next(source)
            except StopIteration:
                return True
            self.add(element)
            buffer.append(element)
        return False

    def add(self, element: Any) -> None:
        """Note an element the op now holds (a list append)."""
        if not self._stale:
            self._fresh.append(element)
            if len(self._fresh) > self.FRESH:
                self._fresh, self._stale = [], True

    def state(self, held: Iterable[Any]) -> Any:
        """The structure of every element the op has held; ``held``: those it holds now."""
        for element in held if self._stale else self._fresh:
            current = self.structure
            if current != ANY and (current is None or not fits(element, current)):
                self.structure = merge(current, structure(element))
        self._fresh, self._stale = [], False
        return self.structure

    def load(self, name: str, key: str, elements: list[Any], saved: Any) -> None:
        """Check a state's held ``elements`` against its recorded structure and adopt it.

        ``saved`` is ``None`` in a state from before structures were recorded (or one that held
        nothing): the elements are then taken unchecked, and looked at with the next state.

        Raises:
            CheckpointError: naming the op, the key and the element that does not fit.
        """
        for i, element in enumerate(elements if saved is not None else ()):
            if not fits(element, saved):
                raise CheckpointError(
                    f"{name}: state[{key!r}] element {i} is {describe_structure(structure(element))}, but the op held "
                    f"{describe_structure(saved)}; is the state damaged or from another pipeline?"
                )
        self.structure, self._fresh, self._stale = saved, [], saved is None and bool(elements)

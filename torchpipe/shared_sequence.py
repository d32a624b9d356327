"""A read-only sequence held once for every worker: items serialized into one buffer.

A map-style dataset that keeps its index as Python objects (a list of paths, a list of label
dicts) is copied into every forked worker bit by bit: reading ``self.samples[i]`` in a worker
writes the item's reference count, and the collector writes the header of every container it
scans, so each page of the index the worker touches becomes a private copy. Over an epoch every
worker ends up with the whole index of its own (torch issue 13246, "DataLoader leaks memory").

:class:`SharedSequence` holds the items as bytes in one numpy buffer plus an array of offsets:
two objects, whatever the number of items, and neither is written when an item is read. A forked
worker reads the parent's pages; nothing is copied. ``seq[i]`` rebuilds the item from its bytes
(a ``str`` is decoded, ``bytes`` are sliced, anything else is unpickled), so each read returns a
new object: mutating it changes nothing in the sequence.

Pickling a :class:`SharedSequence` (a ``spawn`` or ``forkserver`` worker, a Ray actor) copies
its two arrays, which is still two objects rather than millions.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Iterable, Sequence
from typing import Any, overload

import numpy as np

_STR, _BYTES, _PICKLE = "str", "bytes", "pickle"


class SharedSequence(Sequence):
    """A read-only sequence of items kept as bytes in one buffer, shared by forked workers.

    Args:
        items: any iterable of picklable items. When every item is a ``str`` they are stored as
            UTF-8, when every item is ``bytes`` as they are, otherwise each is pickled.

    Raises:
        TypeError: an item cannot be pickled (the message names its index).

    Example::

        class Files(torch.utils.data.Dataset):
            def __init__(self, paths, labels):
                self.samples = tp.SharedSequence(zip(paths, labels))

            def __len__(self):
                return len(self.samples)

            def __getitem__(self, i):
                path, label = self.samples[i]
                return load(path), label
    """

    def __init__(self, items: Iterable[Any]) -> None:
        items = list(items)
        self._kind = _kind_of(items)
        encoded = [_encode(item, self._kind, i) for i, item in enumerate(items)]
        del items
        lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._offsets[1:])
        self._buffer = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._views()

    def _views(self) -> None:
        # memoryviews index and slice several times faster than numpy arrays do
        self._bytes = self._buffer.data
        self._bounds = self._offsets.data

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self._kind, "offsets": self._offsets, "buffer": self._buffer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._kind, self._offsets, self._buffer = state["kind"], state["offsets"], state["buffer"]
        self._views()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        """The item at ``index`` (a new object each time); a slice gives a list of items."""
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"SharedSequence indices must be integers or slices, not {type(index).__name__}"
            ) from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"SharedSequence index {index} out of range for {n} items")
        data = self._bytes[self._bounds[i] : self._bounds[i + 1]]
        if self._kind == _STR:
            return str(data, "utf-8", "surrogatepass")
        if self._kind == _BYTES:
            return bytes(data)
        return pickle.loads(data)

    @property
    def nbytes(self) -> int:
        """Bytes held: the serialized items and their offsets."""
        return int(self._buffer.nbytes + self._offsets.nbytes)

    def __repr__(self) -> str:
        return f"SharedSequence({len(self)} items as {self._kind}, {self.nbytes / 2**20:.1f} MiB)"


def _kind_of(items: list[Any]) -> str:
    if items and all(type(item) is str for item in items):
        return _STR
    if items and all(type(item) is bytes for item in items):
        return _BYTES
    return _PICKLE


def _encode(item: Any, kind: str, index: int) -> bytes:
    if kind == _STR:
        return item.encode("utf-8", "surrogatepass")
    if kind == _BYTES:
        return item
    try:
        return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(
            f"SharedSequence: item {index} ({type(item).__name__}) cannot be pickled: {e}"
        ) from e

"""Batch memory that is reused once the batch it was lent to is freed.

Stacking a large batch into fresh memory costs more than the copy itself: the allocation is
``mmap``-ed and every 4 KB page faults and is zeroed when first written (a 38 MB batch is
9,400 faults, ~5x the time of the copy; with several threads stacking at once they also
contend on the process's page tables). Worker processes avoid it by stacking into their
shared-memory ring, which is written again and again; :class:`RecycledStack` gives batches
stacked in this process the same property.

:meth:`RecycledStack.rows` goes further for a batch built one element at a time: each
element's large tensors are copied into their row of the batch as the element arrives (while
still in cache), so the elements are freed at once instead of living until the batch is
stacked; the stack then finds its rows already in place.

A stacked batch is a tensor over a buffer lent from a small pool. The buffer comes back when
the last tensor or array viewing it is freed (the batch, its slices, views of another dtype):
the lent numpy array is what every view keeps alive, and a ``weakref.finalize`` on it hands
the buffer back. Memory that is still referenced is never reused.

An op that makes a large tensor can skip even the copy to its row: :func:`batch_row` gives it the
row of the batch this thread is building (from the second element on), to write its result into
(``tp.image.train_transform`` does).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchpipe import nest
from torchpipe.runtime.forks import ForkSafeLock

MIN_BYTES = 1 << 20
"""Smaller stacks use ``torch.stack``: the allocator reuses their memory already."""
PLACE_BYTES = 256 << 10
"""Tensors of an element copied to their row as the element arrives; smaller ones wait for the
stack (a copy call per element costs more than it saves: 64 crops of 150 KB ran 30% slower)."""
KEEP = 4
"""Free buffers kept per size; more come back only when the consumer held many batches at once."""
RECHECK_EVERY = 16
"""Where a batch's first element had nothing to place, the next batches skip the check (a
flatten of the element and a call per element: 10 us a batch of dict rows), but for every 16th."""


_building = threading.local()  # the BatchRows this thread is filling, for batch_row
_MADV_DONTNEED = 4  # Linux's madvise advice: drop these pages (private ones read as zeros after)


class _Buffer(mmap.mmap):
    """A batch's memory: a private anonymous mapping of its own, weakly referenced
    (:data:`_BUFFERS`); ``delivered`` while the batch lent in it is the user's
    (:func:`delivered`). Its pages go back to the system the moment it is freed, whatever thread
    made it: a buffer from the C heap, made by a pool thread, stays in that thread's arena once
    freed, whose free top ``malloc_trim`` does not give back (``jpeg``'s DataLoader kept 26 MB of
    its threads' batches after its calls went back to worker processes)."""

    __slots__ = ("delivered",)

    delivered: bool

    def __new__(cls, nbytes: int) -> _Buffer:
        return super().__new__(cls, -1, nbytes, flags=mmap.MAP_PRIVATE)


_BUFFERS: dict[int, weakref.ref[_Buffer]] = {}
"""Every buffer a :class:`RecycledStack` has made that is alive (lent, or kept for reuse), by the
address of its memory (a mapping compares by content: a set would take two zeroed buffers for
one), which is where a batch stacked in it starts."""

_SCALARS = (str, bytes, int, float, bool)


def _register(buffer: _Buffer) -> None:
    # gone from the dict when the buffer is (before its memory can be reused)
    key = np.frombuffer(buffer, np.uint8).ctypes.data
    _BUFFERS[key] = weakref.ref(buffer, lambda _: _BUFFERS.pop(key, None))


def delivered(element: Any) -> None:
    """``element`` goes to the user now: the batches stacked in buffers of ours that it holds are
    the user's, whose code may keep them and read them in a process forked later (a zygote
    keeps their pages; :func:`forget_batches_in_fork`). Called by the pipeline's and the
    DataLoader's ``__next__``; looks only where tensors may be (lists of strings or numbers are
    skipped at their first item)."""
    if not _BUFFERS:
        return
    stack = [element]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            # a batch of ours is a plain strided CPU tensor (sparse ones have no storage)
            if x.layout is not torch.strided or not x.is_cpu or x.is_quantized or x.is_nested:
                continue
            ref = _BUFFERS.get(x.untyped_storage().data_ptr())
            buffer = ref() if ref is not None else None
            if buffer is not None:
                buffer.delivered = True
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)) and x and not isinstance(x[0], _SCALARS):
            stack.extend(x)


def forget_batches_in_fork() -> int:
    """In a process just forked to fork workers (the zygote), let go of the pages of the batches
    the parent stacked: the child never reads them, and the copies it would keep of them (a
    parent's batches alive at the fork: the first calls' results, measured here and waiting to
    be delivered) would be the child's alone once the parent frees them, and each worker's
    share of them besides. Batches delivered to the user are left alone (user code forked with
    them may read them), as are buffers too small to hold a whole page. Only whole pages inside
    each buffer are dropped (its allocator's headers stay); a buffer read after this reads zeros,
    and one lent again is written whole first. Returns the bytes dropped; 0 where ``madvise``
    cannot be called.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return 0
    dropped = 0
    for ref in list(_BUFFERS.values()):
        buffer = ref()
        if buffer is None or buffer.delivered:
            continue
        start = np.frombuffer(buffer, np.uint8).ctypes.data
        first, end = -(-start // page) * page, (start + len(buffer)) // page * page
        if end > first and not libc.madvise(
            ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED
        ):
            dropped += end - first
    return dropped


def batch_row(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
    """The row of the batch this thread is building that the element being made will be placed
    in, for a tensor of ``shape`` and ``dtype``: an op that writes its result there and returns
    it saves the copy into the batch. None where no batch is being built on this thread, or it has
    no rows for such a tensor (as for its first element, whose tensors decide the rows: a tensor
    of a shape and dtype asked for then gets a row however small, as the op will write it in place).

    The k-th call during one element gets the row of the k-th such tensor of the element.
    """
    rows: BatchRows | None = getattr(_building, "rows", None)
    return None if rows is None else rows.row_for(tuple(shape), dtype)


class RecycledStack:
    """``torch.stack(tensors)``, into reused memory for CPU stacks of ``min_bytes`` or more.

    Thread-safe: parallel tasks stack with the same pool, and a buffer may come back on any
    thread. The free buffers go when the pool does (with the iterator that made it).

    The result is a contiguous CPU tensor like ``torch.stack``'s; its storage cannot be
    resized (as with tensors made by ``torch.from_numpy``).
    """

    def __init__(
        self, min_bytes: int = MIN_BYTES, place_bytes: int = PLACE_BYTES, keep: int = KEEP
    ) -> None:
        self._min_bytes = min_bytes
        self.place_bytes = place_bytes
        self._keep = self._asked = keep
        self._kept = True  # whether buffers that come back are kept (keep_freed)
        self._free: dict[int, list[_Buffer]] = defaultdict(list)
        # a buffer given back in a forked worker finds the pool unlocked
        self._lock = ForkSafeLock()
        self._local = threading.local()  # the batch this thread is placing rows of
        self.reused = 0  # lends of a buffer given back earlier (memory already faulted in)
        # batches since one whose first element had nothing to place (0: placing)
        self._unplaced = 0

    def __call__(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        rows: BatchRows | None = getattr(self._local, "rows", None)
        placed = rows.placed(tensors) if rows is not None else None
        if placed is not None:
            return placed
        out = (
            None if any(t.requires_grad for t in tensors) else self.empty(tensors[0], len(tensors))
        )
        if out is None:
            return torch.stack(tensors)  # also what reports a mismatch of shapes, dtypes or devices
        torch.stack(tensors, out=out)
        return out

    def placing(self) -> bool:
        """Whether the next batch should place its elements' rows (:meth:`rows`): yes, unless a
        recent batch's first element had nothing to place (asked again every
        :data:`RECHECK_EVERY` batches). An optimization only: a batch not placed is stacked."""
        if not self._unplaced:
            return True
        self._unplaced = (self._unplaced + 1) % RECHECK_EVERY
        return False

    def rows(self, batch_size: int, lend: bool = True) -> BatchRows:
        """A context for building one batch of ``batch_size`` on this thread: ``place`` each
        element as it arrives, then collate the placed elements (with this stack) inside it.
        ``lend``: whether :func:`batch_row` lends rows to the ops making the elements (only
        where each element is placed as soon as it is made)."""
        return BatchRows(self, batch_size, lend)

    def empty(self, like: torch.Tensor, n: int) -> torch.Tensor | None:
        """A lent batch of ``n`` tensors like ``like``; None where the batch would be small or
        not in CPU memory (``torch.stack`` is as good there)."""
        nbytes = n * like.numel() * like.element_size()
        if nbytes < self._min_bytes or like.device.type != "cpu":
            return None
        return torch.from_numpy(self._lend(nbytes)).view(like.dtype).view((n, *like.shape))

    def _lend(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            owner = free.pop() if free else None
            self.reused += owner is not None
        if owner is None:
            owner = _Buffer(nbytes)
            _register(owner)
        owner.delivered = False
        # np.frombuffer's array is the base that every view of the batch keeps alive (numpy
        # stops collapsing bases at a non-array), so its finalizer runs only when all are gone.
        lent = np.frombuffer(owner, np.uint8)
        weakref.finalize(lent, self._give_back, owner)
        return lent

    def _give_back(self, owner: _Buffer) -> None:
        with self._lock:
            free = self._free[len(owner)]
            if self._kept and len(free) < self._keep:
                free.append(owner)

    def keep_freed(self, keep: bool, most: int | None = None) -> int:
        """Whether buffers that come back are kept for the next batches, ``most`` of a size at
        most (None: the pool's ``keep``; one where batches are made one at a time: the loop's
        batch and the next are all there is). False where this process stops making batches
        (its calls went to worker processes): the free buffers go now, and those still lent
        (batches a buffer or the loop holds) when they come back, not to be kept alongside the
        workers' memory. Returns the bytes let go now (free buffers beyond ``most`` go too: a
        loader inline after a trial on threads kept its four, 38 MB on `jpeg`, where torch's
        DataLoader without workers keeps none)."""
        kept = (self._asked if most is None else most) if keep else 0
        with self._lock:
            self._kept = keep
            if keep:
                self._keep = kept
            dropped = 0
            for size, free in self._free.items():
                dropped += size * len(free[kept:])
                del free[kept:]
            return dropped

    @property
    def free_bytes(self) -> int:
        """The bytes of the buffers kept for reuse (not lent): what this pool holds of its own."""
        with self._lock:
            return sum(size * len(free) for size, free in self._free.items())


class BatchRows:
    """One batch being built on one thread: large tensors go to their rows as elements arrive.

    A tensor is placed when it is a CPU tensor without grad of the shape and dtype its
    component had in the first element, of ``place_bytes`` or more, and the component is large
    across the batch. Anything
    else stays as it is, and the collation then stacks (or rejects) it as usual.
    """

    def __init__(self, memory: RecycledStack, batch_size: int, lend: bool = True) -> None:
        self._memory = memory
        self._size = batch_size
        self._lend = lend
        self._outs: list[torch.Tensor | None] | None = None  # per leaf of the first element
        self._placing = True  # until the first element shows nothing to place
        self._next = 0  # the element being made: placed elements arrive in order
        self._lent: list[int] = []  # the leaves whose row batch_row gave the element being made
        # (shape, dtype) an op asked batch_row for while the first element was made: such
        # tensors get rows however small, since the op then writes its later ones in place
        self._wanted: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._outer: BatchRows | None = None

    def __enter__(self) -> BatchRows:
        self._memory._local.rows = self
        self._outer, _building.rows = getattr(_building, "rows", None), self
        return self

    def __exit__(self, *exc: Any) -> None:
        self._memory._local.rows = None
        _building.rows = self._outer
        self._memory._unplaced = 0 if self._placing else 1
        self._outs = None

    def place(self, j: int, element: Any) -> Any:
        """``element`` with each large tensor replaced by row ``j`` of the batch (a copy)."""
        self._next, lent = j + 1, self._lent
        self._lent = []
        if not self._placing:
            return element  # small elements pay one check
        leaves = nest.flatten(element)
        if self._outs is None:
            self._outs = self._prepare(element, leaves)
            self._placing = any(out is not None for out in self._outs)
        if lent and not _kept(leaves, lent, j, self._outs):
            # a row lent while the element was made is not the element's own tensor: whatever
            # holds it (a function's cache, a buffer) must keep its values, so no row of this
            # batch is written again; the collation stacks the elements into other memory
            self._placing = False
            return element
        if len(leaves) != len(self._outs):
            return element
        # rows written in place: what reads another row is copied out before any is written
        if lent:
            leaves = [_own(leaf, out, j, self._outs) for leaf, out in zip(leaves, self._outs)]
        placed = False
        for k, (leaf, out) in enumerate(zip(leaves, self._outs)):
            if out is not None and _fits(leaf, out):
                row = out[j]
                if not _same(leaf, row):  # else written in place already (batch_row)
                    row.copy_(leaf)
                leaves[k], placed = row, True
        return nest.pack_as(element, leaves) if placed else element

    def row_for(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """:func:`batch_row` for this batch."""
        if not self._lend or not self._placing:
            return None
        if self._outs is None:  # the first element: its tensors decide the rows
            self._wanted.append((shape, dtype))
            return None
        j = self._next
        for k, out in enumerate(self._outs or ()):
            if (
                out is not None
                and k not in self._lent
                and out.shape[1:] == shape
                and out.dtype == dtype
            ):
                if j >= len(out):
                    return None
                self._lent.append(k)
                return out[j]
        return None

    def placed(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The batch, if ``tensors`` are its first rows in order."""
        first = tensors[0]
        out = next(
            (o for o in self._outs or () if o is not None and o.data_ptr() == first.data_ptr()),
            None,
        )
        if out is None or len(tensors) > len(out):
            return None
        row_bytes = out.stride(0) * out.element_size()
        start = out.data_ptr()
        for j, t in enumerate(tensors):
            if (
                t.data_ptr() != start + j * row_bytes
                or t.shape != out.shape[1:]
                or t.dtype != out.dtype
            ):
                return None
        return out if len(tensors) == len(out) else out[: len(tensors)]

    def _large(self, leaf: Any) -> bool:
        """Whether ``leaf`` gets a row: a tensor of ``place_bytes`` or more, or one an op would
        write in place (it asked for a row while the first element was made)."""
        return type(leaf) is torch.Tensor and (
            leaf.numel() * leaf.element_size() >= self._memory.place_bytes
            or (tuple(leaf.shape), leaf.dtype) in self._wanted
        )

    def _prepare(self, element: Any, leaves: list[Any]) -> list[torch.Tensor | None]:
        if type(nest.pack_as(element, leaves)) is not type(element):
            return [None] * len(leaves)  # a container nest cannot rebuild: leave the elements alone
        return [
            self._memory.empty(leaf, self._size)
            if self._large(leaf) and not leaf.requires_grad
            else None
            for leaf in leaves
        ]


def _same(leaf: torch.Tensor, row: torch.Tensor) -> bool:
    return leaf.data_ptr() == row.data_ptr() and leaf.stride() == row.stride()


def _kept(leaves: list[Any], lent: list[int], j: int, outs: list[torch.Tensor | None]) -> bool:
    """Whether each row lent while element ``j`` was made is that element's tensor there."""
    for k in lent:
        out = outs[k]
        leaf = leaves[k] if k < len(leaves) else None
        if out is None or type(leaf) is not torch.Tensor or not _same(leaf, out[j]):
            return False
    return True


def _own(leaf: Any, out: torch.Tensor | None, j: int, outs: list[torch.Tensor | None]) -> Any:
    """``leaf``, copied if it views the batch's memory other than its own row ``j`` (a row lent
    for another of the element's tensors), which placing the element may overwrite."""
    if type(leaf) is not torch.Tensor or (out is not None and _same(leaf, out[j])):
        return leaf
    ptr = leaf.untyped_storage().data_ptr()
    in_batch = any(o is not None and o.untyped_storage().data_ptr() == ptr for o in outs)
    return leaf.clone() if in_batch else leaf


def _fits(leaf: Any, out: torch.Tensor) -> bool:
    return (
        type(leaf) is torch.Tensor
        and leaf.shape == out.shape[1:]
        and leaf.dtype == out.dtype
        and leaf.device.type == "cpu"
        and not leaf.requires_grad
    )

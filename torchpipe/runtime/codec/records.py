"""Element codec: an element as one flat byte record, for passing results through shared memory.

A worker encodes its result and writes the record straight into a shared-memory ring; the main
process decodes it in place (:func:`decode_view`: tensors and arrays view the record) or copies it
out (:func:`decode`). Tensor and array data is copied once into the record; everything else goes
through pickle, so nested tuples, lists, dicts and namedtuples keep their exact types and order.

Record layout (integers little-endian, offsets relative to the start of the record)::

    offset    size     field
    0         4        magic b"TPEC"
    4         2        format version (2; version 1 records are read too: see below)
    6         2        reserved, 0
    8         4        n: number of raw buffers
    12        4        reserved, 0
    16        8        s: skeleton length in bytes
    24        8        total record length in bytes (``EncodedRecord.nbytes``)
    32        16 * n   buffer table: per buffer, u64 length and u64 flags
    32 + 16n  s        skeleton: the element pickled with protocol 5
    ...                each raw buffer, starting at the next multiple of 64

Padding bytes are unspecified. Rings and one-off segments place records on 64-byte boundaries, so
every buffer, and every tensor and array :func:`decode_view` makes, is 64-byte aligned;
:func:`decode` copies arrays to 64-byte-aligned memory and tensors to ``torch.empty`` (aligned the
same) or wherever ``allocate`` puts them. Tensors from torch's ``DataLoader`` are aligned so, and
some CPU kernels round differently on less aligned data.

Buffer flags: bit 0 marks an out-of-band pickle buffer (a ``PickleBuffer`` that pickle handed to
``buffer_callback``; the unpickler takes these in table order), bit 1 marks one that was read-only
(decoded as ``bytes``, otherwise as ``bytearray``). Bits 2-3 mark a blob: 1 ``bytes``,
2 ``bytearray``, 3 ``str`` in UTF-8 (lone surrogates encoded as pickle does, ``surrogatepass``).

In the skeleton every plain strided CPU ``torch.Tensor`` and every ``numpy.ndarray`` of a
fixed-size dtype is a persistent id instead of pickled data, whose buffer holds the element's
bytes in C order:

- tensor: ``(0, buffer index, dtype name, shape, requires_grad)``
- array: ``(1, buffer index, dtype.str or the numpy.dtype itself, shape)``
- tensor stacked with aligned rows (a :class:`StackedTensor` with ``aligned_rows``, which columns
  use): ``(3, buffer index, dtype name, shape, row stride in bytes)``; each row is padded to the
  stride, a multiple of 64, and the stack decodes as a view of the rows, the padding left out
- blob, a ``bytes``, ``bytearray`` or ``str`` of ``codec_pickle.RAW_MIN`` (16 Ki) bytes or
  characters or more: the buffer index alone, an int; the type is in the buffer's flags

Blobs are copied out before the skeleton is unpickled, so pickle copies none of them into the
skeleton on the worker side or out of it on the main side. Version 1 records have no blobs and
no kind 3; they reference bytes of 64 KiB or more as ``(2, buffer index)``.

The same tensor, array or blob object twice in an element is stored once and decodes as one
object (views of one storage are stored separately; equal objects stay distinct). Other tensors
(sparse, quantized, nested, meta, subclasses), array subclasses and object arrays are pickled the
ordinary way, and land where their unpickling puts them; the plain tensors inside them are still
raw buffers.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from torchpipe import nest
from torchpipe.errors import UntrustedTypeError
from torchpipe.runtime.codec.pickling import (
    ALIGN,
    BLOB_MASK,
    BLOB_TYPES,
    OUT_OF_BAND,
    READONLY,
    Allocator,
    RecordPickler,
    RecordUnpickler,
    StackedTensor,
    copy_bytes,
)
from torchpipe.runtime.codec.restricted import RestrictedRecordUnpickler

_MAGIC = b"TPEC"
_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1 (cache files): a version 2 record without its new kinds
_HEADER = struct.Struct("<4sHHIIQQ")
_ENTRY_SIZE = 16


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _as_bytes_view(buf: Any) -> memoryview:
    """A flat unsigned-byte memoryview over ``buf`` (any C-contiguous buffer)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class EncodedRecord:
    """One element ready to be written as a record of ``nbytes`` bytes; made by :func:`encode`.

    It references the element's tensors, arrays and large bytearrays until ``write_into`` copies
    them, so write it before they are modified. ``copied_bytes`` are the bytes :func:`decode_view`
    copies out of the record: the skeleton, blobs and pickle buffers (tensor and array data is
    viewed where it lies).
    """

    __slots__ = ("nbytes", "copied_bytes", "_head", "_skeleton", "_sources", "_offsets")

    def __init__(
        self,
        head: bytes,
        skeleton: bytes,
        sources: list[Any],
        offsets: list[int],
        nbytes: int,
        copied_bytes: int = 0,
    ) -> None:
        self.nbytes = nbytes
        self.copied_bytes = copied_bytes
        self._head = head
        self._skeleton = skeleton
        self._sources = sources
        self._offsets = offsets

    def bytes_in_blocks(self, least: int) -> int:
        """Bytes of the record's tensors, arrays and blobs of ``least`` bytes or more."""
        ends = [*self._offsets[1:], self.nbytes]
        return sum(end - start for start, end in zip(self._offsets, ends) if end - start >= least)

    def write_into(self, buf: memoryview) -> None:
        """Write the record into the first ``nbytes`` bytes of ``buf`` (e.g. a slice of an mmap).

        Raises:
            ValueError: if ``buf`` is read-only or shorter than ``nbytes``.
        """
        view = _as_bytes_view(buf)
        try:
            self._write(view)
        finally:
            if view is not buf:
                view.release()  # a traceback holding it would keep an mmap from being closed

    def _write(self, buf: memoryview) -> None:
        if buf.readonly or len(buf) < self.nbytes:
            got = "a read-only one" if buf.readonly else f"{len(buf)} bytes"
            raise ValueError(
                f"an element record needs a writable buffer of {self.nbytes} bytes, got {got}"
            )
        head_end = len(self._head)
        buf[:head_end] = self._head
        buf[head_end : head_end + len(self._skeleton)] = self._skeleton
        for offset, source in zip(self._offsets, self._sources):
            if type(source) is memoryview:
                copy_bytes(buf[offset : offset + len(source)], source)
            elif isinstance(source, torch.Tensor):
                _copy_strided_tensor(buf, offset, source)
            elif type(source) is StackedTensor:
                _copy_stack(buf, offset, source)
            else:
                _copy_strided_array(buf, offset, source)


def _copy_strided_tensor(buf: memoryview, offset: int, src: torch.Tensor) -> None:
    dst = torch.frombuffer(
        buf, dtype=torch.uint8, count=src.numel() * src.element_size(), offset=offset
    )
    dst.view(src.dtype).view(src.shape).copy_(src)


def _copy_strided_array(buf: memoryview, offset: int, src: np.ndarray) -> None:
    # As unstructured void every element is copied whole: structured dtypes' padding included.
    raw = src.view(np.dtype((np.void, src.itemsize)))
    dst = np.frombuffer(buf, dtype=raw.dtype, count=src.size, offset=offset).reshape(src.shape)
    np.copyto(dst, raw, casting="no")


def _copy_stack(buf: memoryview, offset: int, src: StackedTensor) -> None:
    rows, row_bytes = src.shape[0], math.prod(src.shape[1:]) * src.dtype.itemsize
    dst = torch.frombuffer(buf, dtype=torch.uint8, count=rows * src.row_stride, offset=offset)
    # Rows are row_stride bytes apart: the padding of aligned rows is skipped (stack writes strided).
    rows_view = dst.view(rows, src.row_stride)[:, :row_bytes]
    torch.stack(src.parts, out=rows_view.view(src.dtype).view(src.shape))


def materialize(element: Any) -> Any:
    """``element`` with every :class:`StackedTensor` stacked into a tensor (for a result that
    was made for shared memory but is used in this process after all)."""
    leaves = nest.flatten(element)
    if not any(type(leaf) is StackedTensor for leaf in leaves):
        return element
    return nest.pack_as(
        element, [torch.stack(x.parts) if type(x) is StackedTensor else x for x in leaves]
    )


def encode(element: Any) -> EncodedRecord:
    """Encode ``element`` as a record; tensor and array data is copied later, by ``write_into``.

    Raises:
        TypeError: if part of the element cannot be pickled (the message names that part).
    """
    stream = io.BytesIO()
    pickler = RecordPickler(stream)
    try:
        pickler.dump(element)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(_unpicklable_message(element, e)) from e
    skeleton = stream.getvalue()
    buffers = pickler.buffers
    table: list[int] = []
    sources: list[Any] = []
    offsets: list[int] = []
    end = _HEADER.size + _ENTRY_SIZE * len(buffers) + len(skeleton)
    copied = len(skeleton)
    for source, length, flags in buffers:
        table += (length, flags)
        sources.append(source)
        offsets.append(_align(end))
        end = offsets[-1] + length
        copied += length if flags & (BLOB_MASK | OUT_OF_BAND) else 0
    head = _HEADER.pack(_MAGIC, _VERSION, 0, len(buffers), 0, len(skeleton), end)
    if table:
        head += struct.pack(f"<{len(table)}Q", *table)
    return EncodedRecord(head, skeleton, sources, offsets, end, copied)


def _unpicklable_message(element: Any, error: BaseException) -> str:
    found = _find_unpicklable(element, "element")
    path, obj = found if found is not None else ("element", element)
    return (
        f"could not pickle {path} of type {type(obj).__module__}.{type(obj).__qualname__}: {error}. "
        "Results that cross a process boundary must be picklable: return tensors, numpy arrays or "
        "plain data (numbers, str, bytes, None, tuples, lists, dicts, namedtuples)"
    )


def _find_unpicklable(obj: Any, path: str, seen: set[int] | None = None) -> tuple[str, Any] | None:
    """The path and value of the innermost part of ``obj`` that does not pickle, or None."""
    seen = set() if seen is None else seen
    if nest.is_container(obj) and id(obj) not in seen:
        seen.add(id(obj))  # a container holding itself pickles fine; don't recurse forever
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for key, child in items:
            found = _find_unpicklable(child, f"{path}[{key!r}]", seen)
            if found is not None:
                return found
    try:
        RecordPickler(io.BytesIO()).dump(obj)
    except Exception:  # noqa: BLE001 - any failure to pickle: this is the part that cannot travel
        return path, obj
    return None


def encode_bytes(element: Any) -> bytes:
    """The record of ``element`` as ``bytes`` (for one-off segments and tests).

    Raises:
        TypeError: as :func:`encode`.
    """
    encoded = encode(element)
    # getvalue() hands over the BytesIO's own buffer when no view of it is alive, so the data
    # is copied once, by write_into.
    stream = io.BytesIO()
    stream.seek(encoded.nbytes - 1)
    stream.write(b"\0")
    with stream.getbuffer() as view:
        encoded.write_into(view)
    return stream.getvalue()


def decode(buf: Any, *, allocate: Allocator | None = None, restricted: bool = False) -> Any:
    """Rebuild the element in a record, copying all its data out of ``buf``.

    Nothing in the result views ``buf``, so it may be freed or reused right after.

    Args:
        buf: the record: a memoryview (e.g. of a shared-memory slice), bytes or bytearray; it may
            be longer than the record.
        allocate: ``allocate(shape, dtype)`` returns the contiguous CPU tensor that a decoded
            tensor's data is copied into (e.g. pinned memory); default ``torch.empty``. Arrays
            are copied to fresh 64-byte-aligned memory.
        restricted: unpickle with :mod:`~torchpipe.runtime.codec.restricted`'s allow-list (a
            record read from disk); False (full pickle) for records of this process's children.

    Raises:
        ValueError: if ``buf`` does not hold a complete record of this format version.
        TypeError: if ``allocate`` returns a tensor of the wrong shape or dtype.
        UntrustedTypeError: (restricted) if the record names a type outside the allow-list.
    """
    view = _as_bytes_view(buf)
    # Views are released on the way out, even on errors: a traceback holding them would keep
    # a shared-memory segment from being closed.
    views = [view] if view is not buf else []

    def piece(start: int, end: int) -> memoryview:
        views.append(view[start:end])
        return views[-1]

    try:
        return _load(view, piece, allocate, restricted)
    finally:
        for v in reversed(views):
            v.release()


def decode_view(base: np.ndarray) -> Any:
    """Rebuild the element in a record without copying tensor and array data: they view ``base``.

    ``base`` (a writable 1-d uint8 array over the record, 64-byte aligned) stays alive as long
    as any tensor or array of the element does; put a ``weakref.finalize`` on it to learn when
    the record's memory can be reused. Everything else is copied, as in :func:`decode`.

    Raises:
        ValueError: if ``base`` does not hold a complete record of this format version.
    """
    view = memoryview(base)  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only
    try:
        return _load(view, lambda start, end: base[start:end], None, False)
    finally:
        view.release()


def _load(
    view: memoryview,
    buffer: Callable[[int, int], Any],
    allocate: Allocator | None,
    restricted: bool,
) -> Any:
    """Unpickle the record in ``view``; ``buffer(start, end)`` gives each tensor's or array's source."""
    try:
        skeleton_start, skeleton_end, spans = _read_header(view)
        raw: list[Any] = []
        blobs: dict[int, Any] = {}
        out_of_band: list[Any] = []
        for index, (start, end, flags) in enumerate(spans):
            # Blobs and pickle buffers are copied out now, from plain slices (cheaper than buffer's).
            if flags & BLOB_MASK:
                blobs[index] = BLOB_TYPES[flags & BLOB_MASK](view[start:end])
            elif flags & OUT_OF_BAND:
                out_of_band.append((bytes if flags & READONLY else bytearray)(view[start:end]))
            raw.append(None if flags & (BLOB_MASK | OUT_OF_BAND) else buffer(start, end))
        skeleton = bytes(view[skeleton_start:skeleton_end])
        unpickler = RestrictedRecordUnpickler if restricted else RecordUnpickler
        return unpickler(skeleton, out_of_band, raw, blobs, allocate).load()
    except UntrustedTypeError:
        raise
    except (pickle.UnpicklingError, EOFError, IndexError) as e:
        raise ValueError(f"corrupt element record: its pickled skeleton does not load ({e})") from e


def _read_header(buf: memoryview) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Check the header and buffer table: (skeleton start, skeleton end, (start, end, flags) per buffer)."""
    if len(buf) < _HEADER.size:
        raise ValueError(
            f"truncated element record: {len(buf)} bytes, shorter than its {_HEADER.size}-byte header"
        )
    magic, version, _, count, _, skeleton_len, total = _HEADER.unpack_from(buf)
    if magic != _MAGIC:
        raise ValueError(f"not an element record: magic {bytes(magic)!r}, expected {_MAGIC!r}")
    if version not in _READABLE_VERSIONS:
        raise ValueError(
            f"element record format version {version}, this torchpipe reads versions 1 to {_VERSION}"
        )
    if total > len(buf):
        raise ValueError(
            f"truncated element record: its header says {total} bytes, the buffer has {len(buf)}"
        )
    skeleton_start = _HEADER.size + _ENTRY_SIZE * count
    end = skeleton_end = skeleton_start + skeleton_len
    if skeleton_end > total:
        raise ValueError(
            f"corrupt element record: its header and skeleton need more than its {total} bytes"
        )
    table = struct.unpack_from(f"<{2 * count}Q", buf, _HEADER.size)
    spans = []
    for length, flags in zip(table[0::2], table[1::2]):
        start = _align(end)
        end = start + length
        spans.append((start, end, flags))
    if end != total:
        raise ValueError(
            f"corrupt element record: its buffers end at byte {end}, its header says {total}"
        )
    return skeleton_start, skeleton_end, spans


def decode_bytes(record: bytes, *, restricted: bool = False) -> Any:
    """Rebuild the element in a record made by :func:`encode_bytes` (``restricted``: as :func:`decode`).

    Raises:
        ValueError, UntrustedTypeError: as :func:`decode`.
    """
    return decode(memoryview(record), restricted=restricted)

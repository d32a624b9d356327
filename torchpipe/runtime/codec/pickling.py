"""The pickling half of the element codec: tensors, arrays and large bytes and str as raw buffers.

:class:`RecordPickler` pickles an element's skeleton, turning each plain tensor and array, and
each ``bytes``, ``bytearray`` and ``str`` of :data:`RAW_MIN` or more, into a persistent id that
references a raw buffer of the record; :class:`RecordUnpickler` turns the ids back into objects,
viewing or copying the buffers. The record layout and the persistent id kinds are described in
:mod:`torchpipe.runtime.codec.records`.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

# Flags of the buffer table (record layout: torchpipe.runtime.codec.records)
OUT_OF_BAND = 1
READONLY = 2
BLOB_MASK = 12  # bits 2-3: the buffer is a bytes, bytearray or str, referenced by its index alone
BLOB_BYTES = 4
BLOB_BYTEARRAY = 8
BLOB_STR = 12
ALIGN = 64  # raw buffers start on multiples of it from the record start; arrays are copied to it

_TENSOR = 0
_ARRAY = 1
_BYTES = 2  # version 1 records only: now a blob
_ROWS = 3
# The shortest bytes, bytearray and str (length in characters) written as raw buffers rather than
# pickled into the skeleton. Measured (docs/process_pool.md): a raw buffer costs the main process
# less from 12-20 KiB on, for each of the three, and 30-60% less from 32 KiB; the worker gains
# from 32 KiB on.
RAW_MIN = 16 * 1024
_BLOB_FLAGS: dict[type, int] = {bytes: BLOB_BYTES, bytearray: BLOB_BYTEARRAY, str: BLOB_STR}

# From this size on, copies go through numpy, which releases the GIL while it copies.
_GIL_FREE_COPY_BYTES = 1 << 20


def _plain_torch_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype by name, less the quantized ones (their tensors carry scales; pickle them)."""
    found = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            name = str(value).removeprefix("torch.")
            if not name.startswith(("qint", "quint")):
                found[name] = value
    return found


_TORCH_DTYPES = _plain_torch_dtypes()
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
# Reinterpreting as a same-size integer makes every copy a bit copy (NaN payloads survive) and
# covers dtypes that numpy and some torch kernels lack (bfloat16, float8, bits, complex32).
_SAME_SIZE_INT: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_NUMPY_NATIVE: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
    if hasattr(torch, name)
)
_RAW_ARRAY_KINDS = frozenset("biufcmMSUV")
_NO_BYTES = memoryview(b"")


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    if len(src) < _GIL_FREE_COPY_BYTES:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor without conj/neg bits, as a flat memoryview (no copy)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype not in _NUMPY_NATIVE:
        t = t.view(_SAME_SIZE_INT[t.element_size()])
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only


def _array_bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat memoryview (no copy)."""
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only


def _strided_tensor_source(t: torch.Tensor) -> torch.Tensor | None:
    """What ``write_into`` copies from for a tensor whose bytes are not one contiguous run."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        return t  # a same-dtype copy_ resolves the lazy conjugation/negation
    if t.is_complex() and t.element_size() not in _SAME_SIZE_INT:
        t = torch.view_as_real(t)  # complex128: no 16-byte integer, so two int64 per element
    view_dtype = _SAME_SIZE_INT.get(t.element_size())
    return None if view_dtype is None else t.view(view_dtype)


def _array_dtype_token(dtype: np.dtype) -> str | np.dtype:
    """``dtype.str`` where that rebuilds the dtype exactly, else the dtype itself (pickled)."""
    if dtype.names is None and dtype.metadata is None and dtype.isbuiltin != 2:
        return dtype.str
    return dtype


@functools.lru_cache(maxsize=256)
def _array_dtype(token: str) -> np.dtype:
    return np.dtype(token)


def _add_pickle_buffer(buffers: list[tuple[Any, int, int]], buffer: pickle.PickleBuffer) -> None:
    raw = buffer.raw()
    buffers.append((raw, len(raw), OUT_OF_BAND | (READONLY if raw.readonly else 0)))


def stackable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are plain CPU tensors (strided, needing no gradient) of the first's
    shape and dtype: rows a :class:`StackedTensor` stacks as ``torch.stack`` would (~0.3 us a
    tensor: an attribute a check, no ``device`` object made)."""
    first = tensors[0]
    shape, dtype = first.shape, first.dtype
    for t in tensors:
        if (
            type(t) is not torch.Tensor
            or t.shape != shape
            or t.dtype is not dtype
            or t.requires_grad
            or not t.is_cpu
            or t.layout is not torch.strided
        ):
            return False
    return True


class StackedTensor:
    """Same-shape tensors to be stacked straight into the record that is being written.

    A worker's collation returns these instead of ``torch.stack``-ing: the stack is then the
    one copy into shared memory, and the element decodes as an ordinary tensor. Never seen
    outside a worker.

    Args:
        parts: the tensors, one per row of the stack.
        aligned_rows: start every row on a 64-byte boundary, padding each to a multiple of 64
            bytes; the stack then decodes as a strided view whose rows are meant to be used on
            their own (columns of small elements), each aligned as a tensor of its own would be.

    Raises:
        ValueError: if the tensors differ in shape or dtype.
    """

    __slots__ = ("parts", "shape", "dtype", "row_stride")

    def __init__(
        self, parts: list[torch.Tensor], aligned_rows: bool = False, checked: bool = False
    ) -> None:
        first = parts[0]
        if not checked and any(p.shape != first.shape or p.dtype != first.dtype for p in parts):
            raise ValueError("StackedTensor: the tensors must have one shape and dtype")
        self.parts = parts
        self.shape = (len(parts), *first.shape)
        self.dtype = first.dtype
        row_bytes = first.numel() * first.element_size()
        # Bytes from one row to the next in the record.
        self.row_stride = -(-row_bytes // ALIGN) * ALIGN if aligned_rows else row_bytes


class RecordPickler(pickle.Pickler):
    """Pickles the skeleton, collecting tensors, arrays, blobs and out-of-band buffers as raw buffers.

    ``buffers`` gets one ``(source, length, flags)`` per raw buffer; ``source`` is a flat
    memoryview, or a non-contiguous tensor or array that ``write_into`` copies from.
    """

    def __init__(self, file: io.BytesIO) -> None:
        buffers: list[tuple[Any, int, int]] = []
        # A partial, not a bound method: a pickler -> callback -> pickler cycle would leave every
        # encoded element's sources to the cyclic garbage collector.
        super().__init__(
            file, protocol=5, buffer_callback=functools.partial(_add_pickle_buffer, buffers)
        )
        self.buffers = buffers
        # The ids of objects already referenced, and the objects, kept alive: an object a
        # __reduce__ makes and drops while pickling would otherwise free its id for another.
        self._refs: dict[int, tuple | int] = {}
        self._kept: list[Any] = []

    def persistent_id(self, obj: Any) -> tuple | int | None:
        cls = type(obj)
        if cls is torch.Tensor:
            ref = self._refs.get(id(obj))
            return ref if ref is not None else self._tensor_ref(obj)
        if cls is np.ndarray:
            ref = self._refs.get(id(obj))
            return ref if ref is not None else self._array_ref(obj)
        if cls is StackedTensor:
            return self._stack_ref(obj)
        if cls in _BLOB_FLAGS and len(obj) >= RAW_MIN:
            ref = self._refs.get(id(obj))
            return ref if ref is not None else self._blob_ref(obj)
        return None

    def _blob_ref(self, obj: bytes | bytearray | str) -> int:
        # Pickle would copy the data into the skeleton and, in the main process, out of the
        # record with the skeleton and again into the object: one raw copy each side instead.
        # The reference is a bare int: the elements of a tuple would each pass persistent_id.
        data = memoryview(obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else obj)
        self.buffers.append((data, len(data), _BLOB_FLAGS[type(obj)]))
        return self._remember(obj, len(self.buffers) - 1)

    def _remember(self, obj: Any, ref: Any) -> Any:
        self._refs[id(obj)] = ref
        self._kept.append(obj)
        return ref

    def _stack_ref(self, stacked: StackedTensor) -> tuple:
        nbytes = stacked.shape[0] * stacked.row_stride
        self.buffers.append((stacked if nbytes else _NO_BYTES, nbytes, 0))
        index, name = len(self.buffers) - 1, _TORCH_DTYPE_NAMES[stacked.dtype]
        if nbytes != math.prod(stacked.shape) * stacked.dtype.itemsize:
            return (_ROWS, index, name, stacked.shape, stacked.row_stride)
        return (_TENSOR, index, name, stacked.shape, False)

    def _tensor_ref(self, t: torch.Tensor) -> tuple | None:
        name = _TORCH_DTYPE_NAMES.get(t.dtype)
        if name is None or not t.is_cpu or t.layout is not torch.strided or t.is_nested:
            return None
        nbytes = t.nbytes
        if nbytes == 0:
            source: Any = _NO_BYTES
        elif t.is_contiguous() and not t.is_neg() and not t.is_conj():
            source = _tensor_bytes(t)
        else:
            source = _strided_tensor_source(t)
            if source is None:
                return None
        self.buffers.append((source, nbytes, 0))
        return self._remember(
            t, (_TENSOR, len(self.buffers) - 1, name, tuple(t.shape), t.requires_grad)
        )

    def _array_ref(self, a: np.ndarray) -> tuple | None:
        dtype = a.dtype
        if dtype.kind not in _RAW_ARRAY_KINDS or dtype.hasobject or dtype.itemsize == 0:
            return None
        if a.size == 0:
            source: Any = _NO_BYTES
        else:
            source = _array_bytes(a) if a.flags.c_contiguous else a
        self.buffers.append((source, a.nbytes, 0))
        return self._remember(
            a, (_ARRAY, len(self.buffers) - 1, _array_dtype_token(dtype), a.shape)
        )


class RecordUnpickler(pickle.Unpickler):
    """Unpickles the skeleton, turning each tensor's or array's buffer into a tensor or array
    (a view of the buffer, or a copy), and each blob's index into the blob.

    Args:
        skeleton: the pickled skeleton.
        buffers: the out-of-band pickle buffers, in table order.
        raw: per buffer of the record, the source of a tensor or array (a memoryview, or a uint8
            array to view), or None.
        blobs: the bytes, bytearray and str objects, by buffer index, already made.
        allocate: where decoded tensors are copied to, or None (see ``codec.decode``).
    """

    def __init__(
        self,
        skeleton: bytes,
        buffers: list[Any],
        raw: list[Any],
        blobs: dict[int, Any],
        allocate: Allocator | None,
    ) -> None:
        super().__init__(io.BytesIO(skeleton), buffers=buffers)
        self._raw = raw
        self._blobs = blobs
        self._allocate = allocate
        self._objects: dict[int, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is int:
            blob = self._blobs.get(pid)
            if blob is None:
                raise ValueError(f"corrupt element record: no blob in buffer {pid}")
            return blob
        try:
            kind, index, *meta = pid
            src = self._raw[index]
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"corrupt element record: bad buffer reference {pid!r}") from e
        if src is None:
            raise ValueError(
                f"corrupt element record: {pid!r} references a blob or a pickle buffer"
            )
        obj = self._objects.get(index)
        if obj is None:
            if kind == _TENSOR:
                obj = self._load_tensor(src, *meta)
            elif kind == _ARRAY:
                obj = self._load_array(src, *meta)
            elif kind == _ROWS:
                obj = self._load_rows(src, *meta)
            elif kind == _BYTES and not meta:
                obj = bytes(src)
            else:
                raise ValueError(f"corrupt element record: bad buffer reference {pid!r}")
            self._objects[index] = obj
        return obj

    def _load_tensor(
        self, src: Any, name: str, shape: tuple[int, ...], requires_grad: bool
    ) -> torch.Tensor:
        dtype = _TORCH_DTYPES.get(name)
        if dtype is None:
            raise ValueError(
                f"element record has a tensor of dtype {name!r}, which this torch lacks"
            )
        if len(src) != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"corrupt element record: a {len(src)}-byte buffer for tensor {name}{list(shape)}"
            )
        if isinstance(src, np.ndarray):  # decode_view: a view of the record, no copy
            out = torch.from_numpy(src).view(dtype).view(shape)
            return out.requires_grad_() if requires_grad else out
        if self._allocate is None:
            out = torch.empty(shape, dtype=dtype)
        else:
            out = self._allocate(shape, dtype)
            if (
                out.dtype is not dtype
                or out.shape != shape
                or not out.is_cpu
                or not out.is_contiguous()
            ):
                raise TypeError(
                    f"allocate({shape}, {dtype}) must return a contiguous CPU tensor of that shape and dtype, "
                    f"got {out.dtype} {list(out.shape)} on {out.device}"
                    f"{'' if out.is_contiguous() else ' (not contiguous)'}"
                )
        if len(src):
            copy_bytes(_tensor_bytes(out), src)
        return out.requires_grad_() if requires_grad else out

    def _load_rows(
        self, src: Any, name: str, shape: tuple[int, ...], row_stride: int
    ) -> torch.Tensor:
        """A stack whose rows lie ``row_stride`` bytes apart: a view of the rows, padding left out."""
        dtype = _TORCH_DTYPES.get(name, torch.uint8)  # an unknown name fails in _load_tensor
        row_elems = math.prod(shape[1:])
        stride_elems, misfit = divmod(row_stride, dtype.itemsize)
        if not shape or misfit or stride_elems <= row_elems:
            raise ValueError(
                f"corrupt element record: rows {row_stride} bytes apart for tensor {name}{list(shape)}"
            )
        padded = self._load_tensor(src, name, (shape[0], stride_elems), False)
        return padded[:, :row_elems].view(shape)

    def _load_array(self, src: Any, token: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        dtype = _array_dtype(token) if isinstance(token, str) else token
        if len(src) != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"corrupt element record: a {len(src)}-byte buffer for array {dtype}{list(shape)}"
            )
        if isinstance(src, np.ndarray):  # decode_view: a view of the record, no copy
            return src.view(dtype).reshape(shape)
        out = _aligned_empty(shape, dtype)
        if len(src):
            copy_bytes(_array_bytes(out), src)
        return out


def _utf8_str(data: memoryview) -> str:
    return str(data, "utf-8", "surrogatepass")  # as pickle does: lone surrogates survive


BLOB_TYPES: dict[int, Callable[[memoryview], Any]] = {
    BLOB_BYTES: bytes,
    BLOB_BYTEARRAY: bytearray,
    BLOB_STR: _utf8_str,
}


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array starting on a 64-byte boundary, as torch's allocator
    places tensors (``np.empty`` gets malloc's 16 bytes)."""
    raw = np.empty(math.prod(shape) * dtype.itemsize + ALIGN, np.uint8)
    # The constructor, not a slice: numpy leaves an empty slice's data at the start of ``raw``.
    return np.ndarray(shape, dtype, buffer=raw, offset=-raw.ctypes.data % ALIGN)

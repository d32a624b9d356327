"""The restricted unpickler: what torchpipe reads back from disk is rebuilt as data, never run as code.

Saved datasets, snapshots, cache files and ``save``'s ``progress.pkl`` are pickles (records of
:mod:`torchpipe.runtime.codec.records`, or a plain pickle). Unpickling runs whatever callables a
pickle names, so a file that someone else could write would run their code. Read from disk, a
pickle may name only:

- the element types users store: None, bool, int, float, complex, str, bytes, bytearray, tuple,
  list, dict, set, frozenset, ``collections.OrderedDict``;
- namedtuples (``collections.namedtuple`` and ``typing.NamedTuple``) that are plain, see
  :func:`plain_namedtuple`;
- numpy arrays (object arrays included: their items go through the same checks), dtypes and
  scalars; torch tensors (dense, sparse, meta), dtypes, layouts, devices and sizes, through the
  exact functions numpy and torch pickle them with. A tensor's storage is read by
  ``torch.load(weights_only=True)``, not by the ``torch.load`` of ``torch.storage._load_from_bytes``;
- what the user allowed with :func:`add_safe_globals`.

Anything else raises :class:`~torchpipe.errors.UntrustedTypeError` before it is called, naming the
type and the two ways to allow it: ``tp.add_safe_globals([...])``, or ``trusted=True`` on
``tp.load``, ``cache`` and ``snapshot`` (full pickle). Worker IPC never comes here: it unpickles
what this process's own children wrote.
"""

from __future__ import annotations

import builtins
import collections
import functools
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from torchpipe.errors import UntrustedTypeError
from torchpipe.runtime.codec.pickling import RecordUnpickler
from torchpipe.runtime.forks import ForkSafeLock

_LOCK = ForkSafeLock()  # the allow-list is read in worker processes too
_ALLOWED: dict[
    tuple[str, str], Any
] = {}  # the user's allow-list: (module, qualified name) -> object

# What a class may define beyond its fields and still be rebuilt as a namedtuple without being
# allowed: metadata that no unpickling, hashing or duck-typed argument check ever calls.
_METADATA = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__slots__",
        "__annotations__",
        "__orig_bases__",
        "__firstlineno__",
        "__static_attributes__",
        "__annotate__",
        "__annotate_func__",
        "__annotations_cache__",
        "__parameters__",
        "_field_defaults",
        "__slotnames__",
    }
)
ALLOWED_KINDS = (
    "None, bool, int, float, complex, str, bytes, tuple, list, dict, OrderedDict, plain namedtuples, "
    "numpy arrays and scalars, torch tensors"
)


# -- the user's allow-list ---------------------------------------------------------------------------
def _global_name(obj: Any) -> tuple[str, str]:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if (
        not isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType))
        or not module
        or not qualname
    ):
        raise TypeError(f"add_safe_globals: expected classes or functions, got {obj!r}")
    if "<locals>" in qualname:
        raise TypeError(
            f"add_safe_globals: {module}.{qualname} is defined inside a function; pickle cannot "
            "name it, so no file can hold it"
        )
    return module, qualname


def add_safe_globals(objects: Iterable[type | Callable[..., Any]]) -> None:
    """Allow these classes and functions in what torchpipe reads from disk (as
    ``torch.serialization.add_safe_globals`` does for ``torch.load``).

    Saved datasets (``tp.load``), snapshots, cache files and ``save``'s checkpoint rebuild only
    plain data by default (None, bool, int, float, complex, str, bytes, tuple, list, dict,
    OrderedDict, plain namedtuples, numpy arrays and scalars, torch tensors). A class allowed
    here is rebuilt by whatever its pickle calls (its ``__reduce__``, ``__setstate__``): allow
    only your own, or ones you trust. The list is this process's, and travels with a pipeline to
    its worker processes.

    Args:
        objects: classes or functions, as a pickle names them (``module.qualified_name``).

    Raises:
        TypeError: for anything else, or one defined inside a function.
    """
    names = {_global_name(obj): obj for obj in objects}
    with _LOCK:
        _ALLOWED.update(names)


def get_safe_globals() -> list[Any]:
    """The classes and functions allowed with :func:`add_safe_globals`, in the order they were added."""
    with _LOCK:
        return list(_ALLOWED.values())


def clear_safe_globals() -> None:
    """Forget every class and function allowed with :func:`add_safe_globals`."""
    with _LOCK:
        _ALLOWED.clear()


class SafeGlobals:
    """This process's allow-list as a value that pickles: a reader of files holds one, so that the
    reader unpickled in a worker process allows there what this process allowed when it was sent."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _allow_in_this_process, (tuple(get_safe_globals()),)


def _allow_in_this_process(objects: tuple[Any, ...]) -> SafeGlobals:
    add_safe_globals(objects)
    return SafeGlobals()


# -- what numpy and torch pickle with ----------------------------------------------------------------
def _storage_from_bytes(data: bytes) -> Any:
    """A tensor's storage, as ``torch.storage._load_from_bytes`` rebuilds it, but with torch's own
    restricted unpickler."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _rebuild_tensor(
    storage: Any,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool,
    hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` without backward hooks (they would be callables)."""
    if hooks:
        raise UntrustedTypeError(
            "a tensor in the file has backward hooks, which would be called", "backward_hooks"
        )
    return torch._utils._rebuild_tensor_v2(
        storage, offset, size, stride, requires_grad, collections.OrderedDict(), metadata
    )


def _rebuild_qtensor(
    storage: Any,
    offset: int,
    size: Any,
    stride: Any,
    quantizer: Any,
    requires_grad: bool,
    hooks: Any,
) -> torch.Tensor:
    """``torch._utils._rebuild_qtensor`` (a quantized tensor) without backward hooks."""
    if hooks:
        raise UntrustedTypeError(
            "a tensor in the file has backward hooks, which would be called", "backward_hooks"
        )
    return torch._utils._rebuild_qtensor(
        storage, offset, size, stride, quantizer, requires_grad, collections.OrderedDict()
    )


def _rebuild_sparse_tensor(layout: torch.layout, data: tuple[Any, ...]) -> torch.Tensor:
    """A sparse tensor whose indices are checked against its size (torch checks them after its
    own loads only; unchecked indices would be read out of bounds)."""
    if layout == torch.sparse_coo:
        indices, values, size, *coalesced = data
        return torch.sparse_coo_tensor(
            indices,
            values,
            size,
            check_invariants=True,
            is_coalesced=coalesced[0] if coalesced else None,
        )
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed, plain, values, size = data
        return torch.sparse_compressed_tensor(
            compressed, plain, values, size, layout=layout, check_invariants=True
        )
    raise ValueError(f"a sparse tensor of layout {layout!r}")


@functools.lru_cache(maxsize=1)
def _builtin_globals() -> dict[tuple[str, str], Any]:
    reconstruct = np.array([None], dtype=object).__reduce__()[0]
    scalar = np.float64(0).__reduce__()[0]
    from_buffer = np.zeros(1).__reduce_ex__(5)[
        0
    ]  # protocol 5 arrays; numpy refuses object dtypes there
    found: dict[tuple[str, str], Any] = {
        ("builtins", name): getattr(builtins, name)
        for name in ("complex", "bytearray", "set", "frozenset")
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 and numpy 2 names
        found[module, "_reconstruct"], found[module, "scalar"] = reconstruct, scalar
        found[module.replace("multiarray", "numeric"), "_frombuffer"] = from_buffer
    found.update(
        {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("numpy", "dtype"): np.dtype,
            ("numpy", "ndarray"): np.ndarray,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_qtensor"): _rebuild_qtensor,
            ("torch._utils", "_rebuild_sparse_tensor"): _rebuild_sparse_tensor,
            (
                "torch._utils",
                "_rebuild_meta_tensor_no_storage",
            ): torch._utils._rebuild_meta_tensor_no_storage,
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        }
    )
    return found


# -- namedtuples -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _template(fields: tuple[str, ...]) -> dict[str, Any]:
    """The class body ``collections.namedtuple`` makes for ``fields``."""
    return dict(vars(collections.namedtuple("_", fields)))


def _code(value: Any) -> Any:
    function = getattr(value, "__func__", value)
    code = getattr(function, "__code__", None)
    return None if code is None else (code.co_code, code.co_consts, code.co_names, code.co_varnames)


def _is_namedtuple_body(cls: type) -> bool:
    """Whether ``cls``'s own body is what ``collections.namedtuple`` made, plus metadata."""
    body = vars(cls)
    fields = body.get("_fields")
    if (
        cls.__bases__ != (tuple,)
        or type(fields) is not tuple
        or not all(type(f) is str for f in fields)
    ):
        return False
    template = _template(fields)
    for key, value in body.items():
        if key in _METADATA or (key in fields and type(value) is type(template[key])):
            continue
        if key not in template or (key != "_fields" and _code(value) != _code(template[key])):
            return False
    # Field getters are checked by type: their index is data, and a wrong one just reads another field.
    return body.get("__new__") is not None


def plain_namedtuple(cls: Any) -> bool:
    """Whether ``cls`` is a namedtuple that unpickling can rebuild without running its own code.

    True for a class made by ``collections.namedtuple`` or ``typing.NamedTuple`` (fields, defaults,
    docstring and annotations only), and for subclasses of one that add only ``__slots__`` or a
    docstring. A class with methods of its own (a ``__hash__``, a property that a duck-typed
    argument check could read) is not plain: allow it with :func:`add_safe_globals`.
    """
    if (
        not isinstance(cls, type)
        or type(cls) is not type
        or not issubclass(cls, tuple)
        or cls is tuple
    ):
        return False
    *own, last_tuple, last_object = cls.__mro__
    if (
        last_tuple is not tuple
        or last_object is not object
        or not own
        or not _is_namedtuple_body(own[-1])
    ):
        return False
    return all(set(vars(sub)) <= _METADATA for sub in own[:-1])


def _find_namedtuple(module: str, name: str) -> Any:
    """The plain namedtuple ``module.name`` if its module is imported already (importing one would
    run its code), else None. Looked up in ``__dict__``s: ``getattr`` could run a module's
    ``__getattr__`` or a descriptor."""
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        try:
            found = vars(found)[part]
        except (KeyError, TypeError):
            return None
    return found if plain_namedtuple(found) else None


def find_safe_global(module: str, name: str) -> Any:
    """The object a pickle read from disk may name as ``module.name``.

    Raises:
        UntrustedTypeError: for any other, saying how to allow it.
    """
    found = _builtin_globals().get((module, name))
    if found is None:
        with _LOCK:
            found = _ALLOWED.get((module, name))
    if found is None and module == "torch":
        value = vars(torch).get(name)
        found = (
            value
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.qscheme))
            else None
        )
    if found is None:
        found = _find_namedtuple(module, name)
    if found is None:
        raise UntrustedTypeError(_refusal(module, name), f"{module}.{name}")
    return found


def _refusal(module: str, name: str) -> str:
    base = name.split(".")[0]
    return (
        f"refusing to load {module}.{name} from a file: torchpipe rebuilds only {ALLOWED_KINDS} from disk, "
        "so that a file cannot run code. If you trust the file's writer, allow the type with "
        f"`from {module} import {base}; tp.add_safe_globals([{name}])`, or read the file with trusted=True "
        "(tp.load(path, trusted=True), ds.cache(path, trusted=True), ds.snapshot(path, trusted=True)), "
        "which runs any code the file holds. A namedtuple is rebuilt without either once its module is "
        "imported, unless its class defines methods"
    )


# -- the unpicklers ----------------------------------------------------------------------------------
class RestrictedUnpickler(pickle.Unpickler):
    """A plain pickle's unpickler that rebuilds only what :func:`find_safe_global` allows."""

    def find_class(self, module: str, name: str) -> Any:
        return find_safe_global(module, name)


class RestrictedRecordUnpickler(RecordUnpickler):
    """An element record's unpickler that rebuilds only what :func:`find_safe_global` allows."""

    def find_class(self, module: str, name: str) -> Any:
        return find_safe_global(module, name)

    def _load_array(self, src: Any, token: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        dtype = token if isinstance(token, np.dtype) else np.dtype(token)
        if dtype.hasobject:  # raw bytes as object pointers: a file could point anywhere in memory
            raise ValueError(f"corrupt element record: a raw buffer for an array of dtype {dtype}")
        return super()._load_array(src, token, shape)


def loads(data: bytes) -> Any:
    """Unpickle ``data`` (a plain pickle) with :class:`RestrictedUnpickler`.

    Raises:
        UntrustedTypeError: if it names anything not allowed.
        pickle.UnpicklingError, ValueError, EOFError: if it is damaged.
    """
    return RestrictedUnpickler(io.BytesIO(data)).load()

"""Fingerprints of a pipeline graph: one line per op saying what it is, for checkpoints and caches.

A line is the op's kind and the parameters that decide its elements
(:func:`element_params`), plus a source's length where it is known, e.g.
``batch(batch_size=4, drop_remainder=False)`` or ``range(start=0, stop=40, step=1, len=40)``.
Lines come depth first, as :func:`ops_of` walks the graph, and read the same in every process:
plain data by its text, functions by their name (a lambda re-created in a new process is the
same lambda), any other object by its type; a long value is cut short and ends in a digest of
the whole, so a line stays under a hundred characters.

A checkpoint keeps the lines of its pipeline (``code=False``). A cache file keeps the lines of the
pipeline above it with ``code=True``: each function is also named by a digest of its code, the
values it closes over (an object by its attributes), its defaults, and the functions and plain
constants of its module that it names (also a module's, as ``config.scale``), so that a changed
``map`` function, or a value it reads, is noticed in a new process. A global list or dict is left
out: it is as often state the function keeps (a memo, a log of calls) as data it reads.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.node import Node, Symbol, function_name, walk

MAX_VALUE_TEXT = 60
MAX_HASHED_BYTES = 1 << 24  # a larger array is described by its shape and dtype alone
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def ops_of(root: Node) -> list[Node]:
    """The nodes a checkpoint has a state for, depth first, inputs in order (ops that
    checkpoint as their input, like ``prefetch``, are left out)."""
    return [node for node in walk(root) if not node.checkpoints_as_input]


def describe_ops(root: Node, code: bool = False) -> list[str]:
    """One line per op of ``root``'s graph (see the module docstring)."""
    return [describe_op(node, code) for node in ops_of(root)]


def describe_op(node: Node, code: bool = False) -> str:
    """``kind(name=value, ...)`` for one op; with ``code``, functions carry a digest of their code."""
    params = element_params(node)
    if not node.inputs and "len" not in params and node.cardinality() not in (INFINITE, UNKNOWN):
        params["len"] = node.cardinality()
    body = ", ".join(
        f"{key}={_short(describe_value(value, code))}" for key, value in params.items()
    )
    return f"{node.kind}({body})"


def element_params(node: Node) -> dict[str, Any]:
    """The parameters that decide which elements ``node`` yields: its ``params()`` without its
    ``SPEED_PARAMS``, each function as the callable itself (``params()`` shows its name)."""
    params = {key: value for key, value in node.params().items() if key not in node.SPEED_PARAMS}
    for key, value in params.items():
        attr = getattr(node, key, None)
        if isinstance(value, Symbol) and callable(attr) and value == function_name(attr):
            params[key] = attr
    return params


def describe_value(value: Any, code: bool = False) -> str:
    """``value`` as text that does not change between processes (no ids, no addresses)."""
    if isinstance(value, Symbol):
        return str(value)
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v, code) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(describe_value(v, code) for v in value)) + "}"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{describe_value(k, code)}: {describe_value(v, code)}" for k, v in value.items()
            )
            + "}"
        )
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _describe_array(value)
    if isinstance(value, np.generic):  # a numpy scalar is plain data too
        return f"{type(value).__name__}({value.item()!r})"
    if isinstance(value, type):
        return value.__qualname__
    if callable(value):
        return (
            f"{function_name(value)}#{function_digest(value)}"
            if code
            else str(function_name(value))
        )
    return type(value).__qualname__


def function_digest(fn: Callable[..., Any]) -> str:
    """A digest of what ``fn`` computes: its code, what it closes over, its defaults, and the
    functions and plain constants of its module (or of a module it reads) that it names (12 hex
    digits)."""
    digest = hashlib.sha1()
    for part in _function_parts(fn, depth=0, seen=set()):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()[:12]


def _function_parts(fn: Any, depth: int, seen: set[int]) -> Iterator[str]:
    """What :func:`function_digest` hashes of ``fn``, part by part (``...`` for a callable met
    already, or one nested more than three deep)."""
    if id(fn) in seen or depth > 3:
        yield "..."
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        yield "partial"
        yield from _function_parts(fn.func, depth + 1, seen)
        yield describe_value(fn.args) + describe_value(fn.keywords)
        return
    if isinstance(fn, types.MethodType):  # its object's attributes count, as a callable object's do
        owner = fn.__self__
        yield type(owner).__qualname__
        if not isinstance(owner, type):
            yield from _attribute_parts(owner, depth, seen)
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        yield from _callable_object_parts(fn, depth, seen)
        return
    yield from _code_parts(code)
    yield from _bound_value_parts(fn, depth, seen)
    yield from _named_global_parts(fn, code, depth, seen)


def _attribute_parts(owner: Any, depth: int, seen: set[int]) -> Iterator[str]:
    """The attributes of a method's or a callable object's ``owner``, by name."""
    for name, value in sorted(getattr(owner, "__dict__", {}).items()):
        yield name
        yield from _value_parts(value, depth, seen)


def _callable_object_parts(fn: Any, depth: int, seen: set[int]) -> Iterator[str]:
    """A callable without code of its own: an object (its class's ``__call__`` and its
    attributes), or a builtin (its name is all there is)."""
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - its code is fingerprinted
    yield f"{type(fn).__module__}.{type(fn).__qualname__}"
    if isinstance(call, types.FunctionType):
        yield from _function_parts(call, depth + 1, seen)
        yield from _attribute_parts(fn, depth, seen)
    else:
        yield f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


def _bound_value_parts(fn: types.FunctionType, depth: int, seen: set[int]) -> Iterator[str]:
    """The values ``fn`` carries: its defaults and what it closes over."""
    for value in (fn.__defaults__, fn.__kwdefaults__):
        yield from _value_parts(value, depth, seen)
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name not yet bound)
            continue
        yield from _value_parts(contents, depth, seen)


def _named_global_parts(
    fn: types.FunctionType, code: types.CodeType, depth: int, seen: set[int]
) -> Iterator[str]:
    """The globals ``code`` names that decide what ``fn`` computes: its module's functions and
    plain constants, and a module's plain constants (``config.scale``)."""
    module_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        found = module_globals.get(name)
        if isinstance(found, types.FunctionType) and found.__module__ == fn.__module__:
            yield name
            yield from _function_parts(found, depth + 1, seen)
        # not a list or dict: those are often state the function writes
        elif isinstance(found, _PLAIN):
            yield f"{name}={found!r}"
        elif isinstance(found, types.ModuleType):
            for attr in code.co_names:
                value = vars(found).get(attr)
                if isinstance(value, _PLAIN):
                    yield f"{name}.{attr}={value!r}"


_DATA = (*_PLAIN, list, tuple, dict, set, frozenset, torch.Tensor, np.ndarray)
"""Values described by their contents."""


def _value_parts(value: Any, depth: int, seen: set[int]) -> Iterator[str]:
    if callable(value) and not isinstance(value, type):
        yield from _function_parts(value, depth + 1, seen)
    elif isinstance(value, (*_DATA, type, types.ModuleType)) or not hasattr(value, "__dict__"):
        yield describe_value(value)
    elif id(value) in seen or depth > 3:
        yield "..."
    else:  # an object the function closes over (a config): its type and its attributes
        seen.add(id(value))
        yield type(value).__qualname__
        for name, attribute in sorted(vars(value).items()):
            yield name
            yield from _value_parts(attribute, depth + 1, seen)


def _code_parts(code: types.CodeType) -> Iterator[str]:
    yield code.co_code.hex()
    yield ",".join(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_parts(const)
        else:
            yield describe_value(const)


def _describe_array(value: torch.Tensor | np.ndarray) -> str:
    try:
        if value.nbytes > MAX_HASHED_BYTES:
            raise ValueError("too large to hash")
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            data = (
                np.ascontiguousarray(value).tobytes()
                if value.dtype != object
                else repr(value.tolist()).encode()
            )
        digest = "#" + hashlib.sha1(data).hexdigest()[:8]
    except (RuntimeError, TypeError, ValueError):  # quantized, sparse, ...: shape and dtype only
        digest = ""
    return f"{type(value).__name__}({value.dtype}, {list(value.shape)}{', ' + digest if digest else ''})"


def _short(text: str) -> str:
    if len(text) <= MAX_VALUE_TEXT:
        return text
    return f"{text[:40]}...#{hashlib.sha1(text.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"

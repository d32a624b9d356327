"""The structure of a dataset's elements, as plain JSON data, for a saved dataset's manifest.

``element_spec(element)`` describes one element; ``merge_specs`` joins two descriptions so that
the spec of a whole dataset says what every element has in common: a dimension whose size varies
becomes ``None`` (as in tf.data's ``TensorSpec``), a list whose length varies has ``items: None``,
and parts that differ in kind become ``{"kind": "any"}``. For example::

    {"kind": "tuple", "items": [{"kind": "tensor", "dtype": "float32", "shape": [3, None, None]},
                                {"kind": "int"}]}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchpipe import nest

_SCALARS = {
    bool: "bool",
    int: "int",
    float: "float",
    complex: "complex",
    str: "str",
    bytes: "bytes",
    type(None): "none",
}
ANY = {"kind": "any"}


def element_spec(element: Any) -> dict[str, Any]:
    """A JSON-ready description of ``element``'s structure, dtypes and shapes."""
    if isinstance(element, torch.Tensor):
        return {
            "kind": "tensor",
            "dtype": str(element.dtype).removeprefix("torch."),
            "shape": list(element.shape),
        }
    if isinstance(element, np.ndarray):
        return {"kind": "ndarray", "dtype": element.dtype.str, "shape": list(element.shape)}
    if type(element) in _SCALARS:
        return {"kind": _SCALARS[type(element)]}
    if nest.is_namedtuple(element):
        return {
            "kind": "namedtuple",
            "type": _type_name(element),
            "fields": list(element._fields),
            "items": [element_spec(x) for x in element],
        }
    if isinstance(element, Mapping):
        return {
            "kind": "dict",
            "keys": [k if isinstance(k, str) else repr(k) for k in element],
            "items": [element_spec(x) for x in element.values()],
        }
    if isinstance(element, (tuple, list)):
        return {
            "kind": type(element).__name__
            if type(element) in (tuple, list)
            else _type_name(element),
            "items": [element_spec(x) for x in element],
        }
    return {"kind": "object", "type": _type_name(element)}


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def merge_specs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """What two specs have in common (``None`` stands for no element yet)."""
    if a is None or b is None:
        return a if b is None else b
    if a == b:
        return a
    if a["kind"] != b["kind"] or {k: v for k, v in a.items() if k not in ("items", "shape")} != {
        k: v for k, v in b.items() if k not in ("items", "shape")
    }:
        return dict(ANY)
    merged = dict(a)
    if "shape" in a:
        same_rank = (
            a["shape"] is not None and b["shape"] is not None and len(a["shape"]) == len(b["shape"])
        )
        merged["shape"] = (
            [x if x == y else None for x, y in zip(a["shape"], b["shape"])] if same_rank else None
        )
    if "items" in a:
        if a["items"] is None or b["items"] is None or len(a["items"]) != len(b["items"]):
            merged["items"] = None
        else:
            merged["items"] = [merge_specs(x, y) for x, y in zip(a["items"], b["items"])]
    return merged

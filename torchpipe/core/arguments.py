"""Checks of an op's arguments at the call, each naming the op and the argument and saying what was
expected (TypeError for a wrong type, ValueError for a wrong value).

Each op's ``check_*`` function (beside the op in ``ops/``) is made of these, as are the sources'
checks; a chain method on ``Dataset`` calls them and builds a node.
"""

from __future__ import annotations

import numbers
import os
from typing import Any


def require_int(op: str, name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")


def require_bool(op: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def require_optional_bool(op: str, name: str, value: Any) -> None:
    if value is not None:
        require_bool(op, name, value)


def require_callable(op: str, name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{op}: {name} must be callable, got {type(value).__name__}")


def require_seed(op: str, seed: Any) -> None:
    if seed is not None:
        require_int(op, "seed", seed, minimum=0)


def require_path(op: str, path: Any) -> None:
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"{op}: path must be a str or os.PathLike, got {type(path).__name__}")
    if not os.fspath(path):
        raise ValueError(f"{op}: path must not be empty")

"""Argument checks for the chain methods and sources: each names the op and the argument and says
what was expected, at the call (TypeError for a wrong type, ValueError for a wrong value)."""

from __future__ import annotations

import numbers
import os
from typing import Any

from torchpipe.constants import AUTOTUNE
from torchpipe.ops.map import EXECUTORS
from torchpipe.runtime.ray.executor import RayExecutor
from torchpipe.runtime.ray.executor import resolve as resolve_ray


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


def require_parallelism(op: str, value: Any) -> None:
    if value is not None and value != AUTOTUNE:
        require_int(op, "num_parallel_calls", value, minimum=1)


def require_executor(op: str, executor: Any) -> None:
    if not isinstance(executor, RayExecutor) and (
        not isinstance(executor, str) or executor not in EXECUTORS
    ):
        raise ValueError(
            f"{op}: executor must be one of {EXECUTORS} or a tp.RayExecutor, got {executor!r}"
        )


def ray_parallelism(op: str, executor: Any, num_parallel_calls: int | None) -> int | None:
    """The stage's ``num_parallel_calls`` where it runs on Ray: a ``RayExecutor``'s
    ``num_actors`` where set (an int ``num_parallel_calls`` must agree), else as given, which
    must then say how many run at once."""
    ray = resolve_ray(executor)
    if ray is None:
        return num_parallel_calls
    actors = ray.num_actors
    if actors is not None and num_parallel_calls not in (None, actors):
        raise ValueError(
            f"{op}: num_parallel_calls={num_parallel_calls} and RayExecutor(num_actors={actors}) "
            "disagree; give one of them"
        )
    parallel = ray.parallelism(num_parallel_calls)
    if parallel is None:
        raise ValueError(
            f"{op}: executor={executor!r} runs calls in parallel on Ray actors: give "
            "num_parallel_calls (an int or tp.AUTOTUNE) or RayExecutor(num_actors=...)"
        )
    return parallel


def require_seed(op: str, seed: Any) -> None:
    if seed is not None:
        require_int(op, "seed", seed, minimum=0)


def require_path(op: str, path: Any) -> None:
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"{op}: path must be a str or os.PathLike, got {type(path).__name__}")
    if not os.fspath(path):
        raise ValueError(f"{op}: path must not be empty")

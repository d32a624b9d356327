"""Checks of the values in a state dict, each naming the op and the key."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from torchpipe.errors import CheckpointError


def check_state(name: str, state: dict[str, Any], *keys: str) -> None:
    """Raise CheckpointError unless ``state`` has ``keys``."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"{name}: state is missing {missing}; is it from another pipeline?")


def check_int(
    name: str,
    state: dict[str, Any],
    key: str,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """``state[key]`` as an int.

    Raises:
        CheckpointError: naming the stage and the key, if the value is not an int (a bool or
            the text of a number is not) or lies outside ``[minimum, maximum]``.
    """
    value = state[key]
    if not is_int(value):
        raise CheckpointError(
            f"{name}: state[{key!r}] must be an int, got {type(value).__name__} {value!r}"
        )
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = (
            f"[{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}]"
        )
        raise CheckpointError(f"{name}: state[{key!r}] is {value}, outside {bounds}")
    return int(value)


def check_bool(name: str, state: dict[str, Any], key: str) -> bool:
    """``state[key]`` as a bool.

    Raises:
        CheckpointError: naming the stage and the key, if the value is not a bool.
    """
    value = state[key]
    if not isinstance(value, (bool, np.bool_)):
        raise CheckpointError(
            f"{name}: state[{key!r}] must be a bool, got {type(value).__name__} {value!r}"
        )
    return bool(value)


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (a numpy one too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))

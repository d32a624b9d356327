"""Checks of a state dict's values: present keys, ints and bools, each error naming op and key."""

import numpy as np
import pytest

from torchpipe.core.state import check_bool, check_int, check_state, is_int
from torchpipe.errors import CheckpointError


def test_check_state_names_the_missing_keys():
    check_state("op", {"a": 1, "b": 2}, "a", "b")
    with pytest.raises(CheckpointError, match=r"op: state is missing \['b', 'c'\]"):
        check_state("op", {"a": 1}, "a", "b", "c")


def test_is_int_takes_numpy_ints_but_not_bools_floats_or_text():
    assert is_int(3) and is_int(np.int64(3)) and is_int(np.uint8(0))
    assert not any(is_int(v) for v in (True, np.bool_(True), 3.0, "3", None))


def test_check_int_returns_a_python_int_within_its_bounds():
    value = check_int("op", {"n": np.int32(5)}, "n", minimum=0, maximum=5)
    assert value == 5 and type(value) is int
    assert check_int("op", {"n": -7}, "n") == -7


@pytest.mark.parametrize(
    ("value", "minimum", "maximum", "message"),
    [
        (True, None, None, r"op: state\['n'\] must be an int, got bool True"),
        ("3", None, None, r"op: state\['n'\] must be an int, got str '3'"),
        (1.0, None, None, r"must be an int, got float 1.0"),
        (-1, 0, None, r"op: state\['n'\] is -1, outside \[0, inf\]"),
        (6, None, 5, r"op: state\['n'\] is 6, outside \[-inf, 5\]"),
    ],
)
def test_check_int_refuses_what_is_not_an_int_in_its_bounds(value, minimum, maximum, message):
    with pytest.raises(CheckpointError, match=message):
        check_int("op", {"n": value}, "n", minimum, maximum)


def test_check_bool_takes_python_and_numpy_bools_only():
    assert check_bool("op", {"b": np.bool_(True)}, "b") is True
    assert check_bool("op", {"b": False}, "b") is False
    with pytest.raises(CheckpointError, match=r"op: state\['b'\] must be a bool, got int 1"):
        check_bool("op", {"b": 1}, "b")

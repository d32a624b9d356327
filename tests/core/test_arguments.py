"""The argument checks ops and sources share: each names the op and the argument, TypeError for a
wrong type and ValueError for a wrong value; what they accept passes."""

import pathlib

import pytest

from torchpipe.core.arguments import (
    require_bool,
    require_callable,
    require_int,
    require_optional_bool,
    require_path,
    require_seed,
)


@pytest.mark.parametrize(
    "check, error, message",
    [
        (lambda: require_int("op", "n", 1.0), TypeError, "op: n must be an int, got float"),
        (lambda: require_int("op", "n", True), TypeError, "op: n must be an int, got bool"),
        (lambda: require_int("op", "n", 0, minimum=1), ValueError, "op: n must be >= 1, got 0"),
        (lambda: require_bool("op", "flag", 1), TypeError, "op: flag must be a bool, got int"),
        (lambda: require_optional_bool("op", "flag", "y"), TypeError, "op: flag must be a bool"),
        (lambda: require_callable("op", "fn", 3), TypeError, "op: fn must be callable, got int"),
        (lambda: require_seed("op", -1), ValueError, "op: seed must be >= 0, got -1"),
        (lambda: require_seed("op", "1"), TypeError, "op: seed must be an int, got str"),
        (lambda: require_path("op", 3), TypeError, "op: path must be a str or os.PathLike"),
        (lambda: require_path("op", ""), ValueError, "op: path must not be empty"),
    ],
)
def test_a_bad_argument_names_the_op_and_the_argument(check, error, message):
    with pytest.raises(error) as raised:
        check()
    assert str(raised.value).startswith(message)


def test_good_arguments_pass():
    require_int("op", "n", 0)
    require_int("op", "n", 5, minimum=5)
    require_bool("op", "flag", False)
    require_optional_bool("op", "flag", None)
    require_callable("op", "fn", len)
    require_seed("op", None)
    require_seed("op", 0)
    require_path("op", pathlib.Path("x"))
    require_path("op", b"x")

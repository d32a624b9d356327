"""Fingerprints of a pipeline graph (``torchpipe/storage/fingerprint.py``): one line per op, the
same in every process; values described by their contents and cut short with a digest; with
``code=True`` a function's digest that changes with its code, what it closes over, its defaults and
the module constants it names, and not with a global list it writes."""

from __future__ import annotations

import functools
import sys
import types

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.node import Node, Symbol
from torchpipe.storage import fingerprint
from torchpipe.storage.fingerprint import (
    describe_op,
    describe_ops,
    describe_value,
    function_digest,
    ops_of,
)

THIS = sys.modules[__name__]
config = types.ModuleType("config")
config.scale = 2
_FACTOR = 3
_MEMO: list[int] = []


def _times(x):
    return x * _FACTOR


def _scaled(x):
    return x * config.scale


def _remember(x):
    _MEMO.append(x)
    return x


def _helper(x):
    return x + 1


def _other_helper(x):
    return x + 2


def _calls_helper(x):
    return _helper(x)


def _recursive(n):
    return _recursive(n - 1) if n else 0


def _adds(k):
    return lambda x: x + k


class _Op(Node):
    """A node with the parameters, inputs and cardinality a test gives it."""

    kind = "op"
    SPEED_PARAMS = ("threads",)

    def __init__(self, params, *inputs, cardinality=UNKNOWN):
        super().__init__(*inputs)
        self._params, self._cardinality = params, cardinality

    def build(self, ctx):
        raise NotImplementedError

    def params(self):
        return dict(self._params)

    def cardinality(self):
        return self._cardinality


class _Config:
    def __init__(self, scale):
        self.scale = scale


class _Scaler:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, x):
        return x * self.scale

    def apply(self, x):
        return x * self.scale


# -- lines of a graph ----------------------------------------------------------------------------
def test_describe_ops_gives_one_line_per_op_depth_first_without_speed_params_or_prefetch():
    ds = tp.range(40).map(_helper, num_parallel_calls=2, executor="thread").batch(4).prefetch(2)
    assert describe_ops(ds._node) == [
        "batch(batch_size=4, drop_remainder=False)",
        "map(fn=_helper)",
        "range(start=0, stop=40, step=1, len=40)",
    ]
    assert [node.kind for node in ops_of(ds._node)] == ["batch", "map", "range"]


def test_the_same_pipeline_with_other_speed_settings_has_the_same_lines():
    inline = tp.range(10).map(_helper)
    parallel = tp.range(10).map(
        _helper, num_parallel_calls=4, executor="thread", deterministic=False
    )
    assert describe_ops(inline._node, code=True) == describe_ops(parallel._node, code=True)


def test_a_source_gets_its_length_only_where_it_is_known():
    assert describe_op(_Op({"a": 1}, cardinality=5)) == "op(a=1, len=5)"
    assert describe_op(_Op({"a": 1}, cardinality=UNKNOWN)) == "op(a=1)"
    assert describe_op(_Op({"a": 1}, cardinality=INFINITE)) == "op(a=1)"
    assert describe_op(_Op({"len": 3}, cardinality=5)) == "op(len=3)"  # its own len param stays
    assert describe_op(_Op({}, _Op({}), cardinality=5)) == "op()"  # not a source


def test_an_ops_own_speed_params_are_left_out():
    assert describe_op(_Op({"threads": 8, "size": 2})) == "op(size=2)"


def test_a_function_param_is_named_without_code_and_digested_with_it():
    node = _Op({"fn": Symbol("_helper")})
    node.fn = _helper
    assert describe_op(node) == "op(fn=_helper)"
    assert describe_op(node, code=True) == f"op(fn=_helper#{function_digest(_helper)})"


def test_a_long_value_is_cut_short_and_ends_in_a_digest_of_the_whole():
    long_a, long_b = list(range(100)), [*range(99), 0]
    line_a, line_b = describe_op(_Op({"v": long_a})), describe_op(_Op({"v": long_b}))
    assert len(line_a) < 100 and line_a.startswith("op(v=[0, 1, 2") and "...#" in line_a
    assert line_a != line_b
    assert describe_op(_Op({"v": "x" * 58})) == f"op(v={'x' * 58!r})"  # 60 characters: kept whole


# -- values --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "None"),
        (True, "True"),
        (3, "3"),
        (0.5, "0.5"),
        ("a", "'a'"),
        (b"\x00", "b'\\x00'"),
        ([1, "a"], "[1, 'a']"),
        ((1,), "(1)"),
        ({"k": [1]}, "{'k': [1]}"),
        ({3, 1, 2}, "{1, 2, 3}"),
        (frozenset({"b", "a"}), "{'a', 'b'}"),
        (int, "int"),
        (Symbol("AUTOTUNE"), "AUTOTUNE"),
        (_Config(1), "_Config"),
    ],
)
def test_describe_value_gives_plain_data_by_its_text_and_other_objects_by_their_type(value, text):
    assert describe_value(value) == text


def test_a_function_is_described_by_its_name_and_with_code_by_a_digest_too():
    assert describe_value(_helper) == "_helper"
    assert describe_value(_helper, code=True) == f"_helper#{function_digest(_helper)}"
    assert describe_value([_helper], code=True) == f"[_helper#{function_digest(_helper)}]"


def test_arrays_and_tensors_are_described_by_dtype_shape_and_a_digest_of_their_contents():
    a = describe_value(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert a.startswith("ndarray(int32, [2, 3], #")
    assert a != describe_value(np.arange(1, 7, dtype=np.int32).reshape(2, 3))
    t = describe_value(torch.arange(6).reshape(2, 3))
    assert t.startswith("Tensor(torch.int64, [2, 3], #")
    assert t == describe_value(torch.arange(6).reshape(3, 2).t().t().reshape(2, 3))
    assert describe_value(torch.arange(6).reshape(3, 2).t()) != describe_value(
        torch.arange(6).reshape(2, 3)
    )
    assert describe_value(np.array(["a", None], dtype=object)).startswith("ndarray(object, [2], #")


def test_a_zero_dimensional_tensor_is_described_by_its_value():
    assert describe_value(torch.tensor(1.0)).startswith("Tensor(torch.float32, [], #")
    assert describe_value(torch.tensor(1.0)) != describe_value(torch.tensor(2.0))


def test_a_numpy_scalar_is_described_by_its_value():
    assert describe_value(np.float32(0.5)) != describe_value(np.float32(0.25))
    assert describe_value(np.int64(3)) != describe_value(np.int64(4))
    assert describe_value(np.int64(3)) == describe_value(np.int64(3))


def test_an_array_too_large_to_hash_is_described_by_shape_and_dtype(monkeypatch):
    monkeypatch.setattr(fingerprint, "MAX_HASHED_BYTES", 16)
    assert describe_value(np.zeros(5, np.float32)) == "ndarray(float32, [5])"
    assert describe_value(torch.zeros(5)) == "Tensor(torch.float32, [5])"
    assert describe_value(np.zeros(4, np.float32)).startswith("ndarray(float32, [4], #")


def test_describe_value_holds_no_ids_or_addresses():
    obj = _Config(1)
    assert hex(id(obj))[2:] not in describe_value([obj, _Scaler(2), lambda: 0], code=True)
    assert describe_value(lambda: 0, code=True) == describe_value(lambda: 0, code=True)


# -- function digests ----------------------------------------------------------------------------
def test_a_digest_is_twelve_hex_digits_and_the_same_for_a_recreated_lambda():
    digest = function_digest(_adds(1))
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert function_digest(_adds(1)) == digest


def test_a_digest_changes_with_the_code():
    assert function_digest(lambda x: x + 1) != function_digest(lambda x: x + 2)
    assert function_digest(lambda x: x + 1) != function_digest(lambda x: x - 1)
    # nested code
    assert function_digest(lambda x: [y * 2 for y in x]) != function_digest(
        lambda x: [y * 3 for y in x]
    )


def test_a_digest_changes_with_what_the_function_closes_over_and_its_defaults():
    assert function_digest(_adds(1)) != function_digest(_adds(2))
    assert function_digest(lambda x, k=1: x + k) != function_digest(lambda x, k=2: x + k)
    assert function_digest(lambda x, *, k=1: x + k) != function_digest(lambda x, *, k=2: x + k)
    scale = _Config(1)

    def scaled(x):
        return x * scale.scale

    before = function_digest(scaled)
    scale.scale = 2
    assert function_digest(scaled) != before


def test_a_digest_changes_with_a_module_constant_or_function_it_names(monkeypatch):
    before = function_digest(_times), function_digest(_scaled), function_digest(_calls_helper)
    monkeypatch.setattr(THIS, "_FACTOR", 4)
    monkeypatch.setattr(config, "scale", 5)
    monkeypatch.setattr(THIS, "_helper", _other_helper)
    after = function_digest(_times), function_digest(_scaled), function_digest(_calls_helper)
    assert all(b != a for b, a in zip(before, after))


def test_a_digest_does_not_change_with_a_global_list_the_function_writes():
    before = function_digest(_remember)
    _remember(1)
    try:
        assert function_digest(_remember) == before
    finally:
        _MEMO.clear()


def test_a_digest_of_partials_methods_and_callable_objects_follows_their_values():
    assert function_digest(functools.partial(_adds, 1)) != function_digest(
        functools.partial(_adds, 2)
    )
    assert function_digest(functools.partial(_adds, k=1)) != function_digest(
        functools.partial(_adds, k=2)
    )
    assert function_digest(functools.partial(_adds, 1)) == function_digest(
        functools.partial(_adds, 1)
    )
    assert function_digest(_Scaler(1)) != function_digest(_Scaler(2))
    assert function_digest(_Scaler(1)) == function_digest(_Scaler(1))
    assert function_digest(_Scaler(1).apply) != function_digest(_Scaler(1))
    assert function_digest(_Scaler(1).apply) != function_digest(_Scaler(2).apply)


def test_a_partial_over_a_numpy_scalar_follows_its_value():
    assert function_digest(functools.partial(_adds, np.float32(1))) != function_digest(
        functools.partial(_adds, np.float32(2))
    )


def test_a_builtin_is_digested_by_its_name():
    assert function_digest(len) == function_digest(len)
    assert function_digest(len) != function_digest(abs)


def test_a_recursive_function_or_a_cycle_of_objects_does_not_loop():
    assert len(function_digest(_recursive)) == 12
    a, b = _Config(None), _Config(None)
    a.scale, b.scale = b, a

    def reads(x):
        return a.scale

    assert len(function_digest(reads)) == 12

"""Batching ops: batch, padded_batch, unbatch, rebatch, collate()."""

import collections
import pickle

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.testing import (
    assert_checkpoint_roundtrip,
    assert_elements_equal,
    assert_same_elements,
)

Point = collections.namedtuple("Point", "x y")


def tensors(rows, dtype=torch.int64):
    return [torch.tensor(r, dtype=dtype) for r in rows]


def as_lists(ds):
    return [b.tolist() for b in ds]


def sequences(lengths):
    """Element i is a 1-d int64 tensor of ``lengths[i]`` copies of i + 1."""
    return (
        tp.from_tensor_slices(list(lengths)).enumerate().map(lambda i, n: torch.full((n,), i + 1))
    )


# -- batch ------------------------------------------------------------------------------------
def test_batch_keeps_a_short_last_batch():
    # verified against tf.data 2.21
    expected = [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
        [10, 11, 12, 13, 14],
        [15, 16, 17, 18, 19],
        [20, 21, 22],
    ]
    assert_same_elements(tp.range(23).batch(5), tensors(expected))


def test_batch_drop_remainder():
    # verified against tf.data 2.21
    assert as_lists(tp.range(23).batch(5, drop_remainder=True)) == [
        list(range(i, i + 5)) for i in range(0, 20, 5)
    ]
    assert list(tp.range(4).batch(5, drop_remainder=True)) == []
    assert list(tp.range(0).batch(5)) == []


def test_batch_keeps_tuples_dicts_namedtuples_and_lists():
    def make(i):
        return (
            Point(i, float(i)),
            {"s": str(i), "b": bytes([i]), "a": np.full(2, i, np.int32)},
            [torch.ones(2) * i],
        )

    first = next(iter(tp.range(3).map(make).batch(2)))
    expected = (
        Point(torch.tensor([0, 1]), torch.tensor([0.0, 1.0], dtype=torch.float64)),
        {
            "s": ["0", "1"],
            "b": [b"\x00", b"\x01"],
            "a": torch.tensor([[0, 0], [1, 1]], dtype=torch.int32),
        },
        [torch.tensor([[0.0, 0.0], [1.0, 1.0]])],
    )
    assert_elements_equal(first, expected)


def test_batch_errors_name_the_stage():
    ds = tp.from_iterable([torch.zeros(2), torch.zeros(3)]).batch(2)
    with pytest.raises(ValueError, match=r"^batch: element has different shapes"):
        list(ds)


def test_collate_fn_replaces_collation():
    def pairs(elements):
        return list(zip(elements[::2], elements[1::2]))

    ds = tp.range(7).batch(4, collate_fn=pairs)
    assert list(ds) == [[(0, 1), (2, 3)], [(4, 5)]]
    assert "batch(batch_size=4, drop_remainder=False, collate_fn=pairs)" in ds.explain()


def test_collate_fn_errors_name_the_stage_and_batch():
    def broken(elements):
        raise KeyError("boom")

    with pytest.raises(KeyError) as info:
        list(tp.range(7).batch(4, collate_fn=broken))
    assert any("batch(broken)" in note and "element 0" in note for note in info.value.__notes__)


def test_collate_fn_randomness_survives_a_resume():
    def jitter(elements):
        return torch.tensor(elements) + int(tp.rng().integers(1000))

    ds = tp.range(20).batch(3, collate_fn=jitter).with_options(tp.Options(seed=5))
    assert_checkpoint_roundtrip(ds)


def test_batch_cardinality():
    assert tp.range(23).batch(5).cardinality() == 5
    assert tp.range(23).batch(5, drop_remainder=True).cardinality() == 4
    assert tp.range(20).batch(5).cardinality() == 4
    assert tp.range(0).batch(5).cardinality() == 0
    # verified against tf.data 2.21: unknown after filter, infinite after repeat()
    assert tp.range(10).filter(lambda x: x > 2).batch(3).cardinality() == tp.UNKNOWN
    assert tp.range(10).repeat().batch(3).cardinality() == tp.INFINITE
    assert tp.range(5).padded_batch(2).cardinality() == 3
    assert tp.range(5).padded_batch(2, drop_remainder=True).cardinality() == 2


# -- padded_batch -----------------------------------------------------------------------------
def ramps():
    """Element x (1..5) is ``[x] * x``: 1-d int64 tensors of growing length."""
    return tp.range(1, 6).map(lambda x: torch.full((x,), x))


def test_padded_batch_pads_to_the_batch_maximum():
    # verified against tf.data 2.21
    expected = [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]], [[5, 5, 5, 5, 5]]]
    assert as_lists(ramps().padded_batch(2)) == expected
    assert all(b.dtype == torch.int64 for b in ramps().padded_batch(2))


def test_padded_batch_with_a_fixed_shape_and_padding_value():
    # verified against tf.data 2.21
    expected = [
        [[1, -1, -1, -1, -1, -1], [2, 2, -1, -1, -1, -1]],
        [[3, 3, 3, -1, -1, -1], [4, 4, 4, 4, -1, -1]],
        [[5, 5, 5, 5, 5, -1]],
    ]
    assert as_lists(ramps().padded_batch(2, padded_shapes=[6], padding_values=-1)) == expected
    assert (
        as_lists(
            ramps().padded_batch(2, padded_shapes=torch.Size([6]), padding_values=torch.tensor(-1))
        )
        == expected
    )


def test_padded_batch_of_tuples_with_per_component_shapes_and_values():
    def make(i):
        return np.full([[2, 5, 1, 4, 3][i], 2], i + 0.5, np.float32), i

    ds = (
        tp.range(5).map(make).padded_batch(2, padded_shapes=([-1, 3], []), padding_values=(-1.0, 0))
    )
    out = list(ds)
    # verified against tf.data 2.21
    assert out[0][0].tolist() == [
        [
            [0.5, 0.5, -1.0],
            [0.5, 0.5, -1.0],
            [-1.0, -1.0, -1.0],
            [-1.0, -1.0, -1.0],
            [-1.0, -1.0, -1.0],
        ],
        [[1.5, 1.5, -1.0], [1.5, 1.5, -1.0], [1.5, 1.5, -1.0], [1.5, 1.5, -1.0], [1.5, 1.5, -1.0]],
    ]
    assert out[1][0].tolist() == [
        [[2.5, 2.5, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]],
        [[3.5, 3.5, -1.0], [3.5, 3.5, -1.0], [3.5, 3.5, -1.0], [3.5, 3.5, -1.0]],
    ]
    assert out[2][0].tolist() == [[[4.5, 4.5, -1.0], [4.5, 4.5, -1.0], [4.5, 4.5, -1.0]]]
    assert [labels.tolist() for _, labels in out] == [[0, 1], [2, 3], [4]]
    assert out[0][0].dtype == torch.float32 and out[0][1].dtype == torch.int64


def test_padded_batch_of_dicts_with_strings():
    ds = tp.range(1, 5).map(
        lambda i: {"ids": torch.arange(i), "len": i, "w": float(i), "name": f"n{i}"}
    )
    out = list(ds.padded_batch(3, padding_values={"ids": 9, "len": 0, "w": 0.0, "name": ""}))
    # verified against tf.data 2.21 (tf also pads strings; here they are collected into lists)
    expected = {
        "ids": torch.tensor([[0, 9, 9], [0, 1, 9], [0, 1, 2]]),
        "len": torch.tensor([1, 2, 3]),
        "w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
        "name": ["n1", "n2", "n3"],
    }
    assert_elements_equal(out[0], expected)
    assert out[1]["ids"].tolist() == [[0, 1, 2, 3]]


def test_padded_batch_pads_every_dimension_of_numpy_components():
    ds = tp.from_iterable([np.ones((1, 3), np.int16), np.ones((2, 1), np.int16)]).padded_batch(2)
    expected = torch.tensor([[[1, 1, 1], [0, 0, 0]], [[1, 0, 0], [1, 0, 0]]], dtype=torch.int16)
    assert_elements_equal(next(iter(ds)), expected)


def test_padded_batch_errors_while_iterating():
    with pytest.raises(
        ValueError, match=r"padded_batch: element has shape \(4,\), larger than .* \(3,\)"
    ):
        list(ramps().padded_batch(2, padded_shapes=[3]))
    with pytest.raises(
        ValueError, match=r"padded_shapes for element is \[None, 3\] \(rank 2\).*rank 1"
    ):
        list(ramps().padded_batch(2, padded_shapes=[None, 3]))
    with pytest.raises(ValueError, match="different ranks"):
        list(tp.from_iterable([torch.zeros(2), torch.zeros(2, 2)]).padded_batch(2))
    with pytest.raises(ValueError, match="padded_shapes does not match the element's structure"):
        list(ramps().map(lambda x: (x, x)).padded_batch(2, padded_shapes=([None],)))
    with pytest.raises(ValueError, match=r"padding value 1.5 for element does not fit"):
        list(ramps().padded_batch(2, padding_values=1.5))


# which would run on after the error
NO_PREFETCH = tp.Options(optimizations={"inject_prefetch": False})


class Pulls:
    """A map function that counts the elements pulled."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *x):
        self.calls += 1
        return x[0] if len(x) == 1 else x


@pytest.mark.parametrize(
    "make, pads, error, message",
    [
        (
            lambda: ramps(),
            "x",
            TypeError,
            r"^padded_batch: padding_values for element \(a tensor of dtype torch.int64\) expected a "
            r"number, got str 'x'",
        ),
        (
            lambda: tp.range(5),
            b"x",
            TypeError,
            r"^padded_batch: padding_values for element \(a Python int\) expected a number",
        ),
        (
            lambda: tp.range(5).map(lambda x: (np.zeros(x, np.float32), str(x))),
            ("x", 0),
            TypeError,
            r"padding_values for element\[0\] \(a numpy value of dtype float32\) expected a number, got str",
        ),
        (
            lambda: ramps(),
            1.5,
            ValueError,
            r"^padded_batch: padding value 1.5 for element does not fit its dtype",
        ),
        (
            lambda: ramps().map(lambda x: (x, x)),
            (0, 0, 0),
            ValueError,
            r"^padded_batch: padding_values does not match the element's structure at element",
        ),
        (
            lambda: ramps().map(lambda x: {"a": x}),
            {"b": 0},
            ValueError,
            "padding_values does not match",
        ),
    ],
)
def test_padding_values_that_do_not_fit_the_elements_raise_at_the_first_element(
    make, pads, error, message
):
    pulls = Pulls()
    it = iter(make().map(pulls).padded_batch(4, padding_values=pads).with_options(NO_PREFETCH))
    with pytest.raises(error, match=message):
        next(it)
    assert pulls.calls == 1  # before the batch's other elements are made


def test_padding_values_that_fit_are_not_rejected():
    strings = tp.range(1, 4).map(lambda x: (str(x), torch.full((x,), x)))
    assert as_lists(b for _, b in strings.padded_batch(3, padding_values=("", -1))) == [
        [[1, -1, -1], [2, 2, -1], [3, 3, 3]]
    ]
    assert [s for s, _ in strings.padded_batch(3, padding_values=0)] == [
        ["1", "2", "3"]
    ]  # strings are not padded
    assert as_lists(tp.range(3).padded_batch(3, padding_values=np.int8(7))) == [[0, 1, 2]]


def test_padded_batch_checks_arguments_at_construction():
    with pytest.raises(TypeError, match="padded_shapes"):
        tp.range(3).padded_batch(2, padded_shapes=["a"])
    with pytest.raises(ValueError, match=">= -1"):
        tp.range(3).padded_batch(2, padded_shapes=[-2])
    with pytest.raises(
        TypeError, match=r"^padded_batch: padding_values expected numbers .* got object"
    ):
        tp.range(3).padded_batch(2, padding_values=object())
    with pytest.raises(
        TypeError, match=r"^padded_batch: padding_values expected numbers .* got set"
    ):
        tp.range(3).padded_batch(2, padding_values={0})
    with pytest.raises(ValueError, match="padding_values expected scalars"):
        tp.range(3).padded_batch(2, padding_values=torch.zeros(2))


# -- unbatch ----------------------------------------------------------------------------------
def test_unbatch_splits_every_component():
    assert_same_elements(tp.range(10).batch(4).unbatch(), [torch.tensor(i) for i in range(10)])
    batch = {
        "a": torch.tensor([[1, 2], [3, 4], [5, 6]]),
        "b": ["x", "y", "z"],
        "c": (np.arange(3), [b"p", b"q", b"r"]),
    }
    rows = list(tp.from_iterable([batch]).unbatch())
    assert_elements_equal(rows[1], {"a": torch.tensor([3, 4]), "b": "y", "c": (np.int64(1), b"q")})
    assert len(rows) == 3


def test_unbatch_inverts_batch_of_structures():
    ds = tp.range(7).map(lambda i: Point(torch.full((2,), i), str(i)))
    assert_same_elements(ds.batch(3).unbatch(), ds)


def test_unbatch_errors():
    with pytest.raises(
        ValueError, match=r"unbatch: components disagree.*element\[0\] has 2, element\[1\] has 3"
    ):
        list(tp.from_iterable([(torch.zeros(2), torch.zeros(3))]).unbatch())
    with pytest.raises(ValueError, match=r"cannot split element\[1\]: it is 0-d"):
        list(tp.from_iterable([(torch.zeros(2), torch.tensor(1))]).unbatch())
    with pytest.raises(ValueError, match="cannot split element of type int"):
        list(tp.range(3).unbatch())


def test_unbatch_cardinality():
    # verified against tf.data 2.21: unknown, or infinite for an infinite input
    assert tp.range(12).batch(4).unbatch().cardinality() == tp.UNKNOWN
    assert tp.range(10).batch(4).repeat().unbatch().cardinality() == tp.INFINITE


# -- rebatch ----------------------------------------------------------------------------------
def test_rebatch_cycles_through_sizes():
    # verified against tf.data 2.21
    ds = tp.range(14).batch(4)
    assert as_lists(ds.rebatch([3, 2])) == [
        [0, 1, 2],
        [3, 4],
        [5, 6, 7],
        [8, 9],
        [10, 11, 12],
        [13],
    ]
    assert as_lists(ds.rebatch([3, 2], drop_remainder=True)) == [
        [0, 1, 2],
        [3, 4],
        [5, 6, 7],
        [8, 9],
        [10, 11, 12],
    ]
    assert as_lists(ds.rebatch(3)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13]]
    assert as_lists(ds.rebatch(3, drop_remainder=True)) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, 10, 11],
    ]


def test_rebatch_equals_unbatch_batch_on_structures():
    ds = tp.range(11).map(lambda i: {"x": np.full(2, i, np.float32), "s": str(i)}).batch(4)
    assert_same_elements(ds.rebatch(3), ds.unbatch().batch(3))
    assert "rebatch(batch_sizes=[3, 2], drop_remainder=False)" in ds.rebatch([3, 2]).explain()


def test_rebatch_cardinality():
    assert tp.range(14).batch(4).rebatch(3).cardinality() == tp.UNKNOWN
    assert tp.range(14).batch(4).repeat().rebatch(3).cardinality() == tp.INFINITE


# -- checkpoints ------------------------------------------------------------------------------
PIPELINES = {
    "batch": lambda: tp.range(23).batch(5),
    "batch_drop_under_repeat": lambda: tp.range(23).batch(5, drop_remainder=True).repeat(2),
    "batch_over_repeat": lambda: tp.range(23).repeat(2).batch(5),
    "batch_over_shuffle": lambda: tp.range(23).shuffle(7, seed=1).batch(5),
    "padded_batch": lambda: ramps().repeat(2).padded_batch(3, padding_values=-1),
    "unbatch": lambda: tp.range(23).batch(5).unbatch(),
    "unbatch_under_repeat": lambda: tp.range(23).batch(5).unbatch().repeat(2),
    "unbatch_over_repeat_shuffle": lambda: (
        tp.range(23).batch(4).repeat(2).shuffle(7, seed=1).unbatch()
    ),
    "shuffle_over_unbatch": lambda: tp.range(23).batch(4).unbatch().shuffle(7, seed=1),
    "unbatch_over_parallel_map": lambda: (
        tp.range(23).batch(4).map(abs, num_parallel_calls=3).unbatch().prefetch(2)
    ),
    "unbatch_structures": lambda: (
        tp.range(9).map(lambda i: {"x": np.full(2, i), "s": str(i)}).batch(4).unbatch()
    ),
    "rebatch": lambda: tp.range(23).batch(4).rebatch([3, 2]),
    "rebatch_drop_under_repeat": lambda: (
        tp.range(23).batch(4).rebatch([3, 2], drop_remainder=True).repeat(2)
    ),
    "rebatch_over_repeat": lambda: tp.range(23).batch(4).repeat(2).rebatch(5),
    "rebatch_over_shuffle": lambda: tp.range(23).batch(4).shuffle(7, seed=1).rebatch([3, 2]),
    "rebatch_over_prefetch": lambda: tp.range(23).batch(4).prefetch(3).rebatch([3, 2]),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_checkpoint_roundtrip(name):
    elements = assert_checkpoint_roundtrip(PIPELINES[name]())
    assert elements


def test_unbatch_checkpoint_is_small_mid_element():
    it = iter(tp.range(1000).batch(500).unbatch())
    for _ in range(3):
        next(it)
    state = it.state_dict()
    assert len(pickle.dumps(state)) < 1000
    resumed = iter(tp.range(1000).batch(500).unbatch())
    resumed.load_state_dict(state)
    assert next(resumed).item() == 3

"""collate(): how elements combine into a batch (the default of batch())."""

import collections
import warnings

import numpy as np
import pytest
import torch

from torchpipe.ops.collate import collate
from torchpipe.testing import assert_elements_equal

Point = collections.namedtuple("Point", "x y")


def test_collate_converts_leaves_like_torch_default_collate():
    out = collate(
        [
            (True, 1, 2.5, np.float32(1.5), np.int16(3)),
            (False, 2, 3.5, np.float32(2.5), np.int16(4)),
        ]
    )
    expected = (
        torch.tensor([True, False]),
        torch.tensor([1, 2]),
        torch.tensor([2.5, 3.5], dtype=torch.float64),
        torch.tensor([1.5, 2.5], dtype=torch.float32),
        torch.tensor([3, 4], dtype=torch.int16),
    )
    assert_elements_equal(out, expected)
    assert_elements_equal(collate([1, 2.5]), torch.tensor([1.0, 2.5], dtype=torch.float64))
    assert_elements_equal(
        collate([np.zeros((2, 3), np.uint8)] * 2), torch.zeros((2, 2, 3), dtype=torch.uint8)
    )
    assert_elements_equal(collate([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))


def test_collate_rejects_unsupported_components_naming_their_path():
    elements = [(1, {"image": object()}), (2, {"image": object()})]
    with pytest.raises(
        TypeError, match=r"element\[1\]\['image'\] of type object.*map\(\).*collate_fn"
    ):
        collate(elements)
    with pytest.raises(TypeError, match=r"element\.y of type NoneType"):
        collate([Point(1, None), Point(2, None)])
    with pytest.raises(TypeError, match=r"element\['meta'\]\['tags'\] of type NoneType"):
        # dict rows: paths made on error only
        collate([{"meta": {"tags": None}}, {"meta": {"tags": None}}])
    with pytest.raises(
        ValueError, match=r"differ in keys at element\['meta'\]: \['a'\] vs \['b'\]"
    ):
        collate([{"meta": {"a": 1}}, {"meta": {"b": 1}}])
    with pytest.raises(TypeError, match="numpy dtype <U1"):
        collate([np.array(["a"]), np.array(["b"])])
    with pytest.raises(ValueError, match="non-empty list"):
        collate([])


def test_collate_rejects_elements_of_different_structure():
    with pytest.raises(ValueError, match="differ in structure"):
        collate([(1, 2), (1, 2, 3)])
    with pytest.raises(ValueError, match="differ in structure"):
        collate([(1, 2), [1, 2]])
    with pytest.raises(ValueError, match="differ in keys"):
        collate([{"a": 1}, {"b": 1}])
    with pytest.raises(ValueError, match="differ in structure"):
        collate([(1, 2), (1, (2, 3))])
    with pytest.raises(ValueError, match="mixes types"):
        collate([1, "a"])


def test_collate_rejects_different_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"element\['x'\].*\(2,\) and \(3,\).*padded_batch"):
        collate([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}])
    with pytest.raises(ValueError, match="different dtypes"):
        collate([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    # small numpy arrays are stacked by numpy at once; what differs is still named, not upcast
    with pytest.raises(ValueError, match=r"element\['x'\] has different dtypes.*float32.*float64"):
        collate([{"x": np.zeros(2, np.float32)}, {"x": np.zeros(2, np.float64)}])
    with pytest.raises(ValueError, match=r"\(2,\) and \(3,\)"):
        collate([np.zeros(2), np.zeros(3)])
    small = collate([np.full(3, i, np.float32) for i in range(4)])
    assert small.dtype == torch.float32 and small.tolist() == [[float(i)] * 3 for i in range(4)]


def test_collate_gives_the_same_answers_once_leaf_types_are_known():
    # The common case is answered from a cache keyed by the leaves' type: warm it with
    # homogeneous batches, then check that mixed and bad batches are still judged one by one.
    collate([(torch.zeros(2), 1, 1.5, True)] * 3)
    assert_elements_equal(collate([1, 2.5]), torch.tensor([1.0, 2.5], dtype=torch.float64))
    assert_elements_equal(collate([True, False]), torch.tensor([True, False]))
    with pytest.raises(ValueError, match="differ in structure"):
        collate([(torch.zeros(2), 1), (torch.zeros(2), (1, 2))])
    with pytest.raises(ValueError, match="mixes types"):
        collate([torch.zeros(2), 1])
    with pytest.raises(ValueError, match=r"element\[0\].*\(2,\) and \(3,\)"):
        collate([(torch.zeros(2), 1), (torch.zeros(3), 1)])


def test_collate_names_the_shape_mismatch_when_stacking_into_a_record():
    from torchpipe.ops.collate import collate_in_stage
    from torchpipe.runtime.codec import StackedTensor

    with pytest.raises(ValueError, match=r"batch: element.*\(2,\) and \(3,\)"):
        collate_in_stage([torch.zeros(2), torch.zeros(3)], "batch", stack=StackedTensor)


def test_collate_copies_read_only_arrays_without_a_warning():
    # Ray Data's rows and memory maps hand out arrays that may not be written: torch warns of them.
    arrays = [np.full(3, k, dtype=np.float32) for k in range(2)]
    for a in arrays:
        a.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = collate(arrays)
    assert torch.equal(batch, torch.tensor([[0.0] * 3, [1.0] * 3]))
    assert not any(a.flags.writeable for a in arrays)


def test_collate_takes_dict_rows_by_key_and_names_what_differs():
    # rows may list their keys in any order: the batch has the first row's order
    out = collate([{"a": 1, "b": np.float32(2)}, {"b": np.float32(3), "a": 4}])
    assert list(out) == ["a", "b"]
    assert_elements_equal(out, {"a": torch.tensor([1, 4]), "b": torch.tensor([2.0, 3.0])})
    with pytest.raises(
        ValueError, match=r"differ in structure at element\['m'\]: dict of length 1"
    ):
        collate([{"m": {"a": 1}}, {"m": {"a": 1, "b": 2}}])
    with pytest.raises(
        ValueError, match=r"differ in keys at element: \['a', 'b'\] vs \['a', 'c'\]"
    ):
        collate([{"a": 1, "b": 2}, {"a": 1, "c": 2}])
    with pytest.raises(ValueError, match="differ in structure at element: dict"):
        collate([{"a": 1}, collections.OrderedDict(a=1)])
    # a tuple's and a list's children are named by index, a namedtuple's by field
    with pytest.raises(TypeError, match=r"element\[1\]\[0\] of type NoneType"):
        collate([(1, [None]), (2, [None])])


def test_collate_makes_number_columns_of_the_documented_dtypes():
    assert_elements_equal(
        collate([np.float32(1.5), np.array(2.5, np.float32)]), torch.tensor([1.5, 2.5])
    )
    assert collate([True, False]).dtype == torch.bool
    assert collate([1, 2]).dtype == torch.int64
    with pytest.raises(ValueError, match=r"element does not fit in torch.int64"):
        collate([1, 2**70])
    with pytest.raises(ValueError, match=r"element\['n'\] does not fit in torch.float64"):
        collate([{"n": 1.0}, {"n": 10**400}])

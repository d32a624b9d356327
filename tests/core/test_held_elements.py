"""The structure of the elements an op holds in its state (``torchpipe/core/held_elements.py``):
what a structure records (never shapes or values), merging into what two structures share, which
elements fit, the text errors show, and :class:`HeldStructure`, whose states always load back and
which refuses a held element that does not fit."""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest
import torch

from torchpipe.core.held_elements import (
    ANY,
    MAX_ITEMS,
    HeldStructure,
    describe_structure,
    fits,
    merge,
    structure,
)
from torchpipe.errors import CheckpointError

Point = collections.namedtuple("Point", "x y")


def _merged(*elements):
    result = None
    for element in elements:
        result = merge(result, structure(element))
    return result


# -- structure -----------------------------------------------------------------------------------
def test_a_tensor_or_array_is_its_dtype_and_rank_not_its_shape_or_values():
    assert structure(torch.zeros(2, 3)) == ("tensor", "float32", 2)
    assert structure(torch.ones(5, 1, dtype=torch.int64)) == ("tensor", "int64", 2)
    assert structure(np.zeros(4, np.uint8)) == ("ndarray", "|u1", 1)
    assert structure(torch.tensor(1.5)) == structure(torch.tensor(-2.0))


def test_a_leaf_is_its_type_name_with_its_module_unless_builtin():
    assert structure(3) == ("leaf", "int")
    assert structure("a") == ("leaf", "str")
    assert structure(None) == ("leaf", "NoneType")
    assert structure(np.float32(1)) == ("leaf", "numpy.float32")


def test_containers_record_their_kind_keys_or_length_and_children():
    assert structure((1, "a")) == ("tuple", 2, (("leaf", "int"), ("leaf", "str")))
    assert structure([1]) == ("list", 1, (("leaf", "int"),))
    assert structure({"b": 1, "a": torch.zeros(1)}) == (
        "dict",
        ("b", "a"),
        (("leaf", "int"), ("tensor", "float32", 1)),
    )
    assert structure(Point(1, 2))[0] == f"{__name__}.Point"
    assert structure(collections.OrderedDict(a=1))[0] == "dict"


def test_a_list_longer_than_max_items_is_not_looked_into():
    assert structure(list(range(MAX_ITEMS + 1))) == ("list", MAX_ITEMS + 1, None)
    assert structure(list(range(MAX_ITEMS)))[2] is not None
    assert structure(tuple(range(MAX_ITEMS + 1)))[2] is not None  # only lists


def test_a_structure_is_plain_data_that_torch_load_reads_with_weights_only():
    s = structure(
        {"image": torch.zeros(3, 2, 2), "label": (1, np.zeros(2)), "tags": [Point("a", b"b")]}
    )
    buffer = io.BytesIO()
    torch.save({"structure": s}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"structure": s}


# -- merge ---------------------------------------------------------------------------------------
def test_merging_with_no_element_yet_or_an_equal_structure_gives_the_other():
    s = structure((1, torch.zeros(2)))
    assert merge(None, s) == s and merge(s, None) == s and merge(s, s) == s
    assert merge(None, None) is None


def test_a_dtype_or_rank_that_differs_becomes_a_wildcard():
    assert _merged(torch.zeros(2), torch.zeros(2, dtype=torch.int64)) == ("tensor", None, 1)
    assert _merged(torch.zeros(2), torch.zeros(2, 2)) == ("tensor", "float32", None)
    assert _merged(np.zeros(2), np.zeros((1, 1), np.int8)) == ("ndarray", None, None)


def test_different_kinds_or_leaf_types_merge_to_anything():
    assert _merged(1, "a") == ANY
    assert _merged(1, True) == ANY
    assert _merged(torch.zeros(1), np.zeros(1)) == ANY
    assert _merged((1,), [1]) == ANY
    assert _merged(Point(1, 2), (1, 2)) == ANY
    assert merge(ANY, structure(1)) == ANY and merge(structure(1), ANY) == ANY


def test_containers_of_different_keys_or_lengths_keep_only_their_kind():
    assert _merged({"a": 1}, {"b": 1}) == ("dict", None, None)
    assert _merged({"a": 1, "b": 2}, {"b": 2, "a": 1}) == ("dict", None, None)
    assert _merged([1], [1, 2]) == ("list", None, None)
    assert _merged(list(range(MAX_ITEMS + 1)), list(range(MAX_ITEMS + 1))) == (
        "list",
        MAX_ITEMS + 1,
        None,
    )
    assert _merged(list(range(MAX_ITEMS)), list(range(MAX_ITEMS + 1))) == ("list", None, None)


def test_containers_of_the_same_keys_merge_child_by_child():
    merged = _merged({"x": torch.zeros(2), "y": 1}, {"x": torch.zeros(2, 2), "y": "a"})
    assert merged == ("dict", ("x", "y"), (("tensor", "float32", None), ANY))


# -- fits ----------------------------------------------------------------------------------------
def test_every_element_fits_the_merge_of_the_elements_it_was_merged_from():
    elements = [
        {"x": torch.zeros(2), "y": (1, "a")},
        {"x": torch.zeros(2, 3, dtype=torch.int8), "y": (2, "b")},
        {"x": torch.zeros(1), "y": (3, None)},
    ]
    merged = _merged(*elements)
    assert all(fits(e, merged) for e in elements)
    assert not fits({"x": torch.zeros(2), "y": [1, "a"]}, merged)  # a list for a tuple


@pytest.mark.parametrize(
    ("element", "other"),
    [
        (torch.zeros(2), np.zeros(2, np.float32)),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
        (torch.zeros(2), torch.zeros(1, 2)),
        (np.zeros(2), np.zeros(2, np.float32)),
        (1, "1"),
        (1, torch.tensor(1)),
        ((1, 2), [1, 2]),
        ((1, 2), (1, 2, 3)),
        ((1, 2), Point(1, 2)),
        ({"a": 1}, {"b": 1}),
        ({"a": 1}, {"a": "x"}),
        ({"a": 1}, (1,)),
        ([1], 1),
    ],
)
def test_an_element_of_another_structure_does_not_fit(element, other):
    assert fits(element, structure(element))
    assert not fits(other, structure(element))


def test_anything_fits_the_wildcard_and_wildcard_parts_fit_any_value():
    for x in (1, "a", None, torch.zeros(1), [1, {"a": 2}]):
        assert fits(x, ANY)
    assert fits(torch.zeros(1, 2, 3, dtype=torch.int8), ("tensor", None, None))
    assert fits({"z": 1}, ("dict", None, None)) and not fits([1], ("dict", None, None))
    assert fits(list(range(100)), ("list", 100, None)) and not fits(
        list(range(99)), ("list", 100, None)
    )


# -- describe_structure --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("s", "text"),
    [
        (ANY, "anything"),
        (None, "anything"),
        (("tensor", "float32", 2), "tensor(float32, 2-d)"),
        (("tensor", None, None), "tensor(any dtype, any rank)"),
        (("ndarray", "<f4", 0), "ndarray(<f4, 0-d)"),
        (("leaf", "int"), "int"),
        (("list", None, None), "list(...)"),
        (structure((1, "a")), "tuple(int, str)"),
        (structure({"k": torch.zeros(1)}), "{'k': tensor(float32, 1-d)}"),
        (structure(Point(1, 2)), f"{__name__}.Point(int, int)"),
    ],
)
def test_describe_structure_gives_readable_text(s, text):
    assert describe_structure(s) == text


# -- HeldStructure -------------------------------------------------------------------------------
def test_fill_pulls_until_the_buffer_holds_capacity_and_says_whether_the_source_ended():
    held, buffer, source = HeldStructure(), [], iter(range(5))
    assert held.fill(buffer, source, 3) is False and buffer == [0, 1, 2]
    assert held.fill(buffer, source, 3) is False and buffer == [0, 1, 2]  # already full
    assert held.fill(buffer, source, 10) is True and buffer == [0, 1, 2, 3, 4]
    assert held.state(buffer) == ("leaf", "int")


def test_state_is_none_before_any_element():
    assert HeldStructure().state([]) is None


def test_state_covers_every_element_that_arrived_not_only_those_held_now():
    held = HeldStructure()
    held.add(1)
    held.add("a")
    assert held.state(["a"]) == ANY  # the int left the buffer, but a state taken before held it


def test_state_keeps_what_it_found_across_states():
    held = HeldStructure()
    held.add(torch.zeros(2))
    assert held.state([]) == ("tensor", "float32", 1)
    held.add(torch.zeros(2, 2))
    assert held.state([]) == ("tensor", "float32", None)
    assert held.state([]) == ("tensor", "float32", None)  # nothing new: unchanged


def test_past_fresh_elements_the_state_looks_at_what_is_held_instead():
    held = HeldStructure()
    for i in range(HeldStructure.FRESH + 1):
        held.add(i)
    assert held.state([torch.zeros(1)]) == ("tensor", "float32", 1)  # the ints were not kept


def test_a_state_the_op_made_always_loads_however_its_elements_vary():
    elements = [
        {"a": torch.zeros(i + 1, dtype=dt), "b": [i] * i}
        for i, dt in enumerate([torch.int8, torch.float32])
    ]
    held = HeldStructure()
    for e in elements:
        held.add(e)
    saved = held.state(elements)
    other = HeldStructure()
    other.load("shuffle", "buffer", elements, saved)
    assert other.state(elements) == saved


def test_a_held_element_that_does_not_fit_is_a_checkpoint_error_naming_op_key_and_element():
    saved = structure((torch.zeros(2), 1))
    with pytest.raises(CheckpointError) as info:
        HeldStructure().load("shuffle", "buffer", [(torch.zeros(3), 2), ("swapped", 2)], saved)
    message = str(info.value)
    assert message.startswith("shuffle: state['buffer'] element 1 is tuple(str, int)")
    assert "the op held tuple(tensor(float32, 1-d), int)" in message
    assert "damaged or from another pipeline" in message


def test_a_state_without_a_structure_loads_unchecked_and_is_looked_at_next_time():
    held = HeldStructure()
    held.load("batch", "buckets", ["a", 1], None)
    assert held.structure is None
    assert held.state(["a", 1]) == ANY
    empty = HeldStructure()
    empty.load("batch", "buckets", [], None)
    assert empty.state([]) is None


def test_a_loaded_structure_is_where_the_next_state_starts():
    held = HeldStructure()
    held.load("window", "held", [torch.zeros(1)], ("tensor", "float32", 1))
    held.add(torch.zeros(1, 1))
    assert held.state([]) == ("tensor", "float32", None)

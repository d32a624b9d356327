"""The structure of a dataset's elements for a saved dataset's manifest
(``torchpipe/storage/element_spec.py``): one element's spec as plain JSON data, and merges that say
what every element has in common (varying sizes as ``None``, varying lengths as ``items: None``,
different kinds as ``any``)."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from torchpipe.storage.element_spec import ANY, element_spec, merge_specs

Pair = collections.namedtuple("Pair", "image label")


class _Tuple(tuple):
    pass


def _spec_of_all(*elements):
    spec = None
    for element in elements:
        spec = merge_specs(spec, element_spec(element))
    return spec


# -- one element ---------------------------------------------------------------------------------
def test_a_tensor_or_array_is_its_dtype_and_shape():
    assert element_spec(torch.zeros(3, 4, dtype=torch.uint8)) == {
        "kind": "tensor",
        "dtype": "uint8",
        "shape": [3, 4],
    }
    assert element_spec(torch.tensor(1.5)) == {"kind": "tensor", "dtype": "float32", "shape": []}
    assert element_spec(np.zeros((2,), np.float64)) == {
        "kind": "ndarray",
        "dtype": "<f8",
        "shape": [2],
    }


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (True, "bool"),
        (1, "int"),
        (1.5, "float"),
        (1j, "complex"),
        ("a", "str"),
        (b"a", "bytes"),
        (None, "none"),
    ],
)
def test_a_python_scalar_is_its_kind(value, kind):
    assert element_spec(value) == {"kind": kind}


def test_containers_give_their_kind_keys_and_items():
    assert element_spec((1, "a")) == {"kind": "tuple", "items": [{"kind": "int"}, {"kind": "str"}]}
    assert element_spec([None]) == {"kind": "list", "items": [{"kind": "none"}]}
    assert element_spec({"x": 1, 2: 1.0}) == {
        "kind": "dict",
        "keys": ["x", "2"],
        "items": [{"kind": "int"}, {"kind": "float"}],
    }
    assert element_spec(Pair(torch.zeros(1), 3)) == {
        "kind": "namedtuple",
        "type": f"{__name__}.Pair",
        "fields": ["image", "label"],
        "items": [{"kind": "tensor", "dtype": "float32", "shape": [1]}, {"kind": "int"}],
    }


def test_a_subclass_of_tuple_or_another_object_is_named_by_its_type():
    assert element_spec(_Tuple((1,))) == {"kind": f"{__name__}._Tuple", "items": [{"kind": "int"}]}
    assert element_spec(np.float32(1)) == {"kind": "object", "type": "numpy.float32"}
    assert element_spec(collections.OrderedDict(a=1))["kind"] == "dict"


def test_a_spec_is_json_data_that_reads_back_equal():
    spec = element_spec(
        {
            "image": torch.zeros(3, 2),
            "meta": (Pair(np.zeros(1), b"x"), [1.0, None]),
            (1, 2): object(),
        }
    )
    assert json.loads(json.dumps(spec)) == spec


# -- merging -------------------------------------------------------------------------------------
def test_merging_with_no_element_yet_gives_the_other():
    spec = element_spec((1,))
    assert merge_specs(None, spec) == spec and merge_specs(spec, None) == spec
    assert merge_specs(None, None) is None


def test_a_dimension_whose_size_varies_becomes_none():
    spec = _spec_of_all(torch.zeros(3, 5, 5), torch.zeros(3, 7, 5), torch.zeros(3, 5, 2))
    assert spec == {"kind": "tensor", "dtype": "float32", "shape": [3, None, None]}
    assert _spec_of_all(np.zeros(2), np.zeros(3))["shape"] == [None]


def test_a_rank_that_varies_makes_the_shape_unknown_and_stays_so():
    spec = _spec_of_all(torch.zeros(3), torch.zeros(3, 1))
    assert spec == {"kind": "tensor", "dtype": "float32", "shape": None}
    assert merge_specs(spec, element_spec(torch.zeros(3)))["shape"] is None
    assert merge_specs(element_spec(torch.zeros(3)), spec)["shape"] is None


def test_a_list_whose_length_varies_has_items_none_and_stays_so():
    spec = _spec_of_all([1, 2], [1])
    assert spec == {"kind": "list", "items": None}
    assert merge_specs(spec, element_spec([1, 2])) == {"kind": "list", "items": None}


def test_items_of_the_same_length_merge_one_by_one():
    spec = _spec_of_all((torch.zeros(2, 4), 1), (torch.zeros(2, 6), 1))
    assert spec == {
        "kind": "tuple",
        "items": [{"kind": "tensor", "dtype": "float32", "shape": [2, None]}, {"kind": "int"}],
    }


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, 1.0),
        (True, 1),
        (torch.zeros(2), np.zeros(2, np.float32)),
        (torch.zeros(2), torch.zeros(2, dtype=torch.int64)),
        ((1,), [1]),
        ({"a": 1}, {"b": 1}),
        ({"a": 1, "b": 1}, {"b": 1, "a": 1}),
        (Pair(1, 2), (1, 2)),
        (np.float32(1), np.float64(1)),
    ],
)
def test_parts_that_differ_in_kind_type_dtype_or_keys_become_any(a, b):
    assert _spec_of_all(a, b) == ANY
    assert merge_specs(ANY, element_spec(a)) == ANY and merge_specs(element_spec(a), ANY) == ANY


def test_a_merge_does_not_change_its_inputs():
    a, b = element_spec((torch.zeros(2), [1])), element_spec((torch.zeros(3), [1, 2]))
    a_text, b_text = json.dumps(a), json.dumps(b)
    merged = merge_specs(a, b)
    assert merged == {
        "kind": "tuple",
        "items": [
            {"kind": "tensor", "dtype": "float32", "shape": [None]},
            {"kind": "list", "items": None},
        ],
    }
    assert json.dumps(a) == a_text and json.dumps(b) == b_text
    different = _spec_of_all(1, "a")
    different["kind"] = "changed"  # a merged "any" is a copy
    assert ANY == {"kind": "any"}

"""Run a pipeline with one optimizer pass on and with none, and compare."""

from __future__ import annotations

from typing import Any

import torchpipe as tp
from torchpipe.core.node import Node
from torchpipe.ops.passthrough import WithOptionsNode
from torchpipe.options import OPTIMIZATIONS
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements, running_node

NONE = dict.fromkeys(OPTIMIZATIONS, False)


def only(ds: tp.Dataset, *names: str) -> tp.Dataset:
    """``ds`` with just the passes ``names`` switched on."""
    return ds.with_options(tp.Options(optimizations={**NONE, **dict.fromkeys(names, True)}))


def unoptimized(ds: tp.Dataset) -> tp.Dataset:
    return ds.with_options(tp.Options(optimizations=NONE))


def assert_pass_keeps_output(
    ds: tp.Dataset, name: str, applies: bool = True, roundtrip: bool = True
) -> list[Any]:
    """With only ``name`` on, ``ds`` yields exactly what it yields with no pass on, and resumes
    exactly from every position; ``applies`` says whether the pass must have rewritten it."""
    on = only(ds, name)
    assert (name in rewrites(on)) is applies, on.explain()
    expected = list(unoptimized(ds))
    assert_same_elements(list(on), expected)
    if roundtrip:
        assert_checkpoint_roundtrip(on)
    return expected


def rewrites(ds: tp.Dataset) -> dict[str, list[str]]:
    """The rewrites that apply to ``ds``: each pass's name and what it did (``explain(as_dict=True)``)."""
    return ds.explain(as_dict=True)["rewrites"]


def run_labels(ds: tp.Dataset) -> list[str]:
    """Every op of ``ds`` as it will run, as ``explain()`` labels it, root first."""
    labels, stack = [], [ds.explain(as_dict=True)["as_run"]]
    while stack:
        op = stack.pop()
        labels.append(op["label"])
        stack.extend(reversed(op["inputs"]))
    return labels


def running_root(ds: tp.Dataset) -> Node:
    """The root node that will run, below any ``with_options``."""
    root = running_node(ds)
    while isinstance(root, WithOptionsNode):
        root = root.inputs[0]
    return root

"""filter_fusion: ``filter(p).filter(q)`` becomes one stage keeping what both keep."""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.graph.passes._elementwise import apply_fusion
from torchpipe.options import Options

NAME = "filter_fusion"


def _only_filters(outer: tuple[str, ...], inner: tuple[str, ...]) -> bool:
    return set(outer) == set(inner) == {"filter"}


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    return apply_fusion(root, options, notes, NAME, _only_filters)

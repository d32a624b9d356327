"""map_filter_fusion: ``map(f).filter(p)`` becomes one stage; in parallel the filter runs
where the map ran and dropped elements never travel back."""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.graph.passes._elementwise import apply_fusion
from torchpipe.options import Options

NAME = "map_filter_fusion"


def _filters_after_map(outer: tuple[str, ...], inner: tuple[str, ...]) -> bool:
    return set(outer) == {"filter"} and inner[-1] == "map"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    return apply_fusion(root, options, notes, NAME, _filters_after_map)

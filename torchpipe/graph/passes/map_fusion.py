"""map_fusion: ``map(f).map(g)`` becomes one stage calling ``g(f(x))``."""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.graph.passes._elementwise import apply_fusion
from torchpipe.options import Options

NAME = "map_fusion"


def _only_maps(outer: tuple[str, ...], inner: tuple[str, ...]) -> bool:
    return set(outer) == set(inner) == {"map"}


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    return apply_fusion(root, options, notes, NAME, _only_maps)

"""map_parallelization: a sequential map of a pure function runs in parallel with AUTOTUNE.

A function is pure when declared so (``map(fn, pure=True)`` or ``@tp.pure``): its result
depends only on its element (and on ``tp.rng()``), and it has no side effects that the
caller relies on. Order is kept (deterministic) unless the pipeline says otherwise.
"""

from __future__ import annotations

from torchpipe.constants import AUTOTUNE
from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up, with_attrs
from torchpipe.ops.map import MapNode
from torchpipe.options import Options

NAME = "map_parallelization"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        if not (type(node) is MapNode and node.num_parallel_calls is None and node.pure):
            return None
        notes.append(f"{NAME}: {node.label()} -> num_parallel_calls=AUTOTUNE")
        return with_attrs(node, num_parallel_calls=AUTOTUNE)

    return rewrite_bottom_up(root, rule)

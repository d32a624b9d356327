"""vectorize: ``map(fn, batched=True).batch(n)`` becomes ``batch(n).map(fn)``: one call per batch.

``batched=True`` declares that ``fn`` gives the same batch whether it is applied to each
element before collation or once to the collated batch, i.e.
``fn(collate(xs)) == collate([fn(x) for x in xs])`` (elementwise tensor arithmetic, for
example). Such a function must not draw random numbers: one call per batch draws
differently from one call per element. Only a plain ``batch`` (not ``padded_batch``) is
rewritten.
"""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up, with_inputs
from torchpipe.ops.batch import BatchNode
from torchpipe.ops.map import MapNode
from torchpipe.options import Options

NAME = "vectorize"


def apply(root: Node, options: Options, notes: list[str]) -> Node:
    def rule(node: Node) -> Node | None:
        below = node.inputs[0] if node.inputs else None
        if not (type(node) is BatchNode and type(below) is MapNode and below.batched):
            return None
        batch = with_inputs(node, below.inputs)
        notes.append(
            f"{NAME}: {below.label()} + {node.label()} -> {node.label()} + {below.name} once per batch"
        )
        return with_inputs(below, (batch,))

    return rewrite_bottom_up(root, rule)

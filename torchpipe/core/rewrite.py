"""The machinery every pass shares: bottom-up, copy-on-write rewriting of a node graph.

Rewrites return new nodes and never touch the graph as written (the user's ``Dataset`` and
its checkpoints name the ops as written). A node is copied only when something below it
changed; a node reachable along two paths is rewritten once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torchpipe.core.node import Node

Rule = Callable[[Node], "Node | None"]
"""Given a node (its inputs already rewritten), its replacement, or None to keep it."""


def with_inputs(node: Node, inputs: tuple[Node, ...]) -> Node:
    """``node``, or a shallow copy of it over ``inputs`` if they differ."""
    if len(inputs) == len(node.inputs) and all(new is old for new, old in zip(inputs, node.inputs)):
        return node
    copied = copy.copy(node)
    copied.inputs = inputs
    return copied


def with_attrs(node: Node, **attrs: object) -> Node:
    """A shallow copy of ``node`` with ``attrs`` set."""
    copied = copy.copy(node)
    for name, value in attrs.items():
        setattr(copied, name, value)
    return copied


def rewrite_bottom_up(root: Node, rule: Rule) -> Node:
    """``root`` with ``rule`` applied to every node, inputs before consumers.

    A replacement is not offered to ``rule`` again, but its inputs were (so fusing a chain
    of three maps happens in two steps: the inner pair, then the outer map onto that).
    """
    memo: dict[int, Node] = {}

    def visit(node: Node) -> Node:
        key = id(node)
        if key not in memo:
            current = with_inputs(node, tuple(visit(child) for child in node.inputs))
            replaced = rule(current)
            memo[key] = current if replaced is None else replaced
        return memo[key]

    return visit(root)

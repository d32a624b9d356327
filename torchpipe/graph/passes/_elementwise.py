"""What map_fusion, filter_fusion and map_filter_fusion share: fusing two adjacent stages.

Two stages fuse into one ``FusedMapNode`` when their parallel settings agree:
- both inline: the fused stage is inline;
- one parallel: the fused stage runs in parallel with its settings, so the inline function
  moves onto the threads or workers. In a pipeline with a seed, an inline function seeds the
  global RNGs before each call and threads cannot, so this happens there only when the
  parallel stage uses processes (or Ray actors) or the inline function is declared pure;
- both parallel: the same ``deterministic``, and executors that agree (``"auto"`` agrees
  with either); the fused parallelism is the larger (``AUTOTUNE`` if either is).
A parallel chain calls every function with the input's sequence number, so there a filter
can only be the last stage (inline, each stage counts the elements that reach it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchpipe.constants import AUTOTUNE
from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up
from torchpipe.ops.filter import FilterNode
from torchpipe.ops.fused import FusedMapNode, is_pure_stage
from torchpipe.ops.map import MapNode, executor_kind
from torchpipe.ops.passthrough import ElidedNode
from torchpipe.options import Options

Kinds = tuple[str, ...]
"""A stage's functions, innermost first: ``"map"`` or ``"filter"`` each."""


def stage_kinds(node: Node) -> Kinds | None:
    """The kinds of ``node``'s functions if it is an element-wise stage, else None."""
    if isinstance(node, FusedMapNode):
        return tuple("filter" if isinstance(s, FilterNode) else "map" for s in node.stages)
    if type(node) is MapNode:
        return ("map",)
    if type(node) is FilterNode:
        return ("filter",)
    return None


def _settings(node: Node) -> tuple[Any, ...] | None:
    if isinstance(node, MapNode) and node.num_parallel_calls is not None:
        return node.num_parallel_calls, node.deterministic, node.executor
    return None


def _merge(outer: Node, inner: Node, options: Options) -> tuple[Any, ...] | None:
    """The fused stage's (num_parallel_calls, deterministic, executor), or None if they clash."""
    a, b = _settings(outer), _settings(inner)
    if a is None and b is None:
        return None, None, "auto"
    if a is None or b is None:
        parallel, inline = (a, inner) if b is None else (b, outer)
        assert parallel is not None  # not both None (above)
        # Worker processes and Ray actors seed the global RNGs per element, as inline calls do.
        seeds_per_element = executor_kind(parallel[2]) in ("process", "ray")
        if options.seed is not None and not seeds_per_element and not is_pure_stage(inline):
            return None
        return parallel
    if a[1] != b[1] or (a[2] != b[2] and "auto" not in (a[2], b[2])):
        return None
    executor = b[2] if a[2] == "auto" else a[2]
    parallelism = AUTOTUNE if AUTOTUNE in (a[0], b[0]) else max(a[0], b[0])
    return parallelism, a[1], executor


def fuse(
    node: Node, options: Options, allowed: Callable[[Kinds, Kinds], bool]
) -> FusedMapNode | None:
    """``node`` fused with the element-wise stage below it (looking through elided no-ops),
    when ``allowed(outer_kinds, inner_kinds)`` and their settings agree; else None."""
    outer_kinds = stage_kinds(node)
    if outer_kinds is None:
        return None
    between: tuple[Node, ...] = ()
    inner = node.inputs[0]
    if isinstance(inner, ElidedNode):
        between, inner = inner.hops, inner.inputs[0]
    inner_kinds = stage_kinds(inner)
    if inner_kinds is None or not allowed(outer_kinds, inner_kinds):
        return None
    settings = _merge(node, inner, options)
    if settings is None:
        return None
    kinds = inner_kinds + outer_kinds
    if settings[0] is not None and "filter" in kinds[:-1]:
        return None  # in parallel a stage after a filter would see the wrong sequence number
    outer_hops, _ = FusedMapNode.flatten(node)
    inner_hops, below = FusedMapNode.flatten(inner)
    return FusedMapNode((*outer_hops, *between, *inner_hops), below, *settings)


def apply_fusion(
    root: Node,
    options: Options,
    notes: list[str],
    name: str,
    allowed: Callable[[Kinds, Kinds], bool],
) -> Node:
    """``root`` with every adjacent pair of stages that ``allowed`` accepts fused."""

    def rule(node: Node) -> Node | None:
        fused = fuse(node, options, allowed)
        if fused is not None:
            where = "inline" if fused.num_parallel_calls is None else "in parallel"
            notes.append(
                f"{name}: {' + '.join(s.name for s in fused.stages)} -> one stage, {where}"
            )
        return fused

    return rewrite_bottom_up(root, rule)

"""Element-wise chains run as one stage: what map_fusion, filter_fusion and map_filter_fusion make.

A chain of ``map`` and ``filter`` ops becomes one node: one iterator, and when parallel one
task (one dispatch, one transfer) per element for the whole chain. Every function keeps the
context, and so the seed, it has in the graph as written, and the sequence number it would
see: inline, each stage counts the elements that reach it; in parallel, every stage sees the
input's sequence number, which is why a parallel chain may have filters only at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_state
from torchpipe.errors import CheckpointError
from torchpipe.ops.filter import DROPPED, FilterNode, as_bool
from torchpipe.ops.map import MapNode, is_pure
from torchpipe.ops.passthrough import ElidedNode, walk_contexts

if TYPE_CHECKING:
    from torchpipe.runtime.ray.executor import RayExecutor

STAGE_TYPES = (MapNode, FilterNode)


class FusedMapNode(MapNode):
    """The maps and filters in ``hops`` as one stage.

    Args:
        hops: the fused nodes as written, outermost first (maps, filters, and elided no-ops
            between them).
        input: the node below the innermost hop.
        num_parallel_calls, deterministic, executor: the fused stage's; ``None`` parallelism
            runs inline.
    """

    kind = "fused_map"

    def __init__(
        self,
        hops: tuple[Node, ...],
        input: Node,
        num_parallel_calls: int | None,
        deterministic: bool | None,
        executor: str | RayExecutor,
    ) -> None:
        self.hops = hops
        self.stages = tuple(
            hop for hop in reversed(hops) if isinstance(hop, STAGE_TYPES)
        )  # innermost first
        name = "+".join(stage.name for stage in self.stages)
        super().__init__(input, None, num_parallel_calls, deterministic, executor, name)  # type: ignore[arg-type]  # no one fn: each hop's
        self.pure = all(is_pure_stage(stage) for stage in self.stages)

    @staticmethod
    def flatten(node: Node) -> tuple[tuple[Node, ...], Node]:
        """``node`` as hops (outermost first) and the node below them."""
        if isinstance(node, (FusedMapNode, ElidedNode)):
            return node.hops, node.inputs[0]
        return (node,), node.inputs[0]

    def has_filter(self) -> bool:
        return any(isinstance(stage, FilterNode) for stage in self.stages)

    def params(self) -> dict[str, Any]:
        return {"stages": [stage.label() for stage in self.stages], **self.parallel_params()}

    def label(self) -> str:
        inner = " -> ".join(stage.label() for stage in self.stages)
        extra = ", ".join(f"{k}={v!r}" for k, v in self.parallel_params().items())
        text = f"fused[{inner}]" + (f"({extra})" if extra else "")
        return text + (" [source pushed down]" if self.dataset is not None else "")

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return walk_contexts(self.hops, ctx)

    def _functions(
        self, ctx: BuildContext, seed_globals: bool | None
    ) -> list[tuple[bool, str, UserFunction]]:
        """``(is_filter, name, function)`` per stage, innermost first, each in its own context."""
        out = []
        for hop in self.hops:
            if isinstance(hop, STAGE_TYPES):
                is_filter = isinstance(hop, FilterNode)
                fn = hop.predicate if isinstance(hop, FilterNode) else hop.fn
                out.append((is_filter, hop.name, UserFunction(fn, hop.name, ctx, seed_globals)))
            ctx = hop.elided_context(ctx)
        out.reverse()
        return out

    def function(self, ctx: BuildContext, seed_globals: bool | None = None) -> ChainFunction:
        return ChainFunction(self._functions(ctx, seed_globals))

    def build(self, ctx: BuildContext) -> Iterator:
        if self.num_parallel_calls is None:
            return ChainIterator(self.name, ctx.build_input(self), self._functions(ctx, None))
        return super().build(ctx)


def is_pure_stage(node: Node) -> bool:
    """Whether a map or filter node's function was declared pure."""
    if isinstance(node, FilterNode):
        return is_pure(node.predicate)
    return isinstance(node, MapNode) and node.pure


class ChainFunction:
    """The stages of a parallel chain, all called with the input's sequence number.

    Returns ``DROPPED`` for an element a filter stage rejects.
    """

    __slots__ = ("stages",)

    def __init__(self, stages: list[tuple[bool, str, UserFunction]]) -> None:
        self.stages = stages

    @property
    def seeds_globals(self) -> bool:
        return any(fn.seeds_globals for _, _, fn in self.stages)

    def seed_worker(self, slot: int) -> None:
        self.stages[0][2].seed_worker(slot)

    def on_elements(
        self, first: int, elements: list, then: Callable[[int, Any], Any] | None = None
    ) -> list:
        """:meth:`on_element` for elements numbered from ``first`` on; ``then(j, result)`` takes
        each result (as :meth:`UserFunction.on_elements`)."""
        mapped = [self.on_element(first + j, element) for j, element in enumerate(elements)]
        return mapped if then is None else [then(j, result) for j, result in enumerate(mapped)]

    def on_element(self, seq: int, element: Any) -> Any:
        for is_filter, name, fn in self.stages:
            if is_filter:
                if not as_bool(name, fn.on_element(seq, element)):
                    return DROPPED
            else:
                element = fn.on_element(seq, element)
        return element


class ChainIterator(Iterator):
    """Runs the chain inline; each stage numbers the elements that reach it, as unfused."""

    INPUT, COUNTS = "input", "counts"

    def __init__(
        self, name: str, source: Iterator, stages: list[tuple[bool, str, UserFunction]]
    ) -> None:
        super().__init__(name, source)
        self._source = source
        self._stages = stages
        self._counts = [0] * len(stages)

    def next(self) -> Any:
        stages, counts = self._stages, self._counts
        while True:
            element = next(self._source)
            for i, (is_filter, name, fn) in enumerate(stages):
                seq = counts[i]
                counts[i] = seq + 1
                if not is_filter:
                    element = fn.on_element(seq, element)
                elif not as_bool(name, fn.on_element(seq, element)):
                    break
            else:
                return element

    def get_state(self) -> dict[str, Any]:
        return {self.INPUT: self._source.state_dict(), self.COUNTS: list(self._counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, self.COUNTS)
        counts = state[self.COUNTS]
        valid = isinstance(counts, list) and len(counts) == len(self._stages)
        if not valid or not all(type(n) is int and n >= 0 for n in counts):
            raise CheckpointError(
                f"{self.name}: state['counts'] must be {len(self._stages)} counts, got {counts!r}"
            )
        self._source.load_state_dict(state[self.INPUT])
        self._counts = list(counts)

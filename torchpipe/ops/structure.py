"""Ops that reshape the stream without looking at elements: repeat, take, skip, shard,
enumerate, scan, and ``with_options`` (which only carries options)."""

from __future__ import annotations

import copy
from typing import Any, Callable

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.ops.base import (
    BuildContext,
    Iterator,
    Node,
    PassThroughIterator,
    UserFunction,
    check_bool,
    check_int,
    check_state,
    function_name,
)
from torchpipe.options import Options


class RepeatNode(Node):
    """The input ``count`` times over (``-1``: forever); each repetition is a fresh pass."""

    kind = "repeat"

    def __init__(self, input: Node, count: int) -> None:
        super().__init__(input)
        self.count = count

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if self.count < 0:
            return 0 if n == 0 else INFINITE
        if self.count == 0:
            return 0
        return n if n in (INFINITE, UNKNOWN) else n * self.count

    def build(self, ctx: BuildContext) -> Iterator:
        return RepeatIterator(self, ctx)

    def elided_context(self, ctx: BuildContext) -> BuildContext:
        return self.input_context(ctx, 0).repetition(0)


class RepeatIterator(Iterator):
    """Rebuilds its input for every repetition (so random ops below draw anew each time).

    Like tf.data, an endless repeat of an input that turns out empty ends instead of spinning.
    Once it has ended, its state is the last repetition's at that repetition's end (the same
    structure as every other state): resuming there finds the end again.
    """

    REPETITION, INPUT, FRESH = "repetition", "input", "fresh"

    def __init__(self, node: Node, ctx: BuildContext) -> None:
        super().__init__(node.kind)
        self._node = node
        self._ctx = node.input_context(ctx, 0)
        self._repetition = 0
        self._fresh = True  # nothing produced yet in this repetition
        self._final: dict[str, Any] | None = None  # the state once ended
        self._source: Iterator | None = self._make_source() if node.count != 0 else None

    def _make_source(self) -> Iterator:
        ctx = self._ctx.repetition(self._repetition)
        source = ctx.traced(self._node.inputs[0].build(ctx))
        self.inputs = [source]
        return source

    def next(self) -> Any:
        while self._source is not None:
            try:
                element = next(self._source)
            except StopIteration:
                self._advance()
                continue
            self._fresh = False
            return element
        raise StopIteration

    def _advance(self) -> None:
        empty = self._fresh
        count = self._node.count
        if (count < 0 and empty) or (count >= 0 and self._repetition + 1 >= count):
            self._final = self.get_state()
            self._release(self._source)
            self._source = None
            self.inputs = []
            return
        self._release(self._source)
        self._repetition += 1
        self._fresh = True
        self._source = self._make_source()

    def _release(self, source: Iterator) -> None:
        """Done with one repetition's iterator."""
        source.close()

    def get_state(self) -> dict[str, Any]:
        if self._source is None:
            return copy.deepcopy(self._final) if self._final is not None else {
                self.REPETITION: self._repetition, self.INPUT: None, self.FRESH: self._fresh}
        return {self.REPETITION: self._repetition, self.INPUT: self._source.state_dict(), self.FRESH: self._fresh}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.REPETITION, self.INPUT, self.FRESH)
        repetition = check_int(self.name, state, self.REPETITION, minimum=0)
        if self._source is not None:
            self._release(self._source)
        self._repetition = repetition
        self._fresh = check_bool(self.name, state, self.FRESH)
        self._final = None
        if state[self.INPUT] is None or self._node.count == 0:
            self._source = None
            self.inputs = []
        else:
            self._source = self._make_source()
            self._source.load_state_dict(state[self.INPUT])


class TakeNode(Node):
    """The first ``count`` elements (``-1``: all)."""

    kind = "take"

    def __init__(self, input: Node, count: int) -> None:
        super().__init__(input)
        self.count = count

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n == UNKNOWN:
            return UNKNOWN
        if n == INFINITE:
            return self.count
        return n if self.count < 0 else min(n, self.count)

    def build(self, ctx: BuildContext) -> Iterator:
        return TakeIterator(self.kind, ctx.build_input(self), self.count)


class TakeIterator(PassThroughIterator):
    COUNTERS = ("taken",)

    def __init__(self, name: str, source: Iterator, count: int) -> None:
        super().__init__(name, source)
        self._count = count
        self._taken = 0

    def next(self) -> Any:
        if 0 <= self._count <= self._taken:
            raise StopIteration
        element = next(self._source)
        self._taken += 1
        return element


class SkipNode(Node):
    """All but the first ``count`` elements (``-1``: skip everything)."""

    kind = "skip"

    def __init__(self, input: Node, count: int) -> None:
        super().__init__(input)
        self.count = count

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        return 0 if self.count < 0 else max(0, n - self.count)

    def build(self, ctx: BuildContext) -> Iterator:
        return SkipIterator(self.kind, ctx.build_input(self), self.count)


class SkipIterator(PassThroughIterator):
    COUNTERS = ("skipped",)

    def __init__(self, name: str, source: Iterator, count: int) -> None:
        super().__init__(name, source)
        self._count = count
        self._skipped = 0

    def next(self) -> Any:
        while self._count < 0 or self._skipped < self._count:
            next(self._source)
            self._skipped += 1
        return next(self._source)


class ShardNode(Node):
    """Every ``num_shards``-th element, starting at ``index``."""

    kind = "shard"

    def __init__(self, input: Node, num_shards: int, index: int) -> None:
        super().__init__(input)
        self.num_shards = num_shards
        self.index = index

    def params(self) -> dict[str, Any]:
        return {"num_shards": self.num_shards, "index": self.index}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        return n // self.num_shards + (1 if self.index < n % self.num_shards else 0)

    def build(self, ctx: BuildContext) -> Iterator:
        return ShardIterator(self.kind, ctx.build_input(self), self.num_shards, self.index)


class ShardIterator(PassThroughIterator):
    """Keeps the input elements at positions ``index, index + num_shards, ...``.

    The others are skipped (a source that can seek does not read them), and an error raised by
    one of them is dropped: it belongs to the shard that keeps that element.
    """

    COUNTERS = ("position",)

    def __init__(self, name: str, source: Iterator, num_shards: int, index: int) -> None:
        super().__init__(name, source)
        self._num_shards = num_shards
        self._index = index
        self._position = 0  # input elements consumed

    def next(self) -> Any:
        source = self._source
        while True:
            position = self._position
            if position % self._num_shards == self._index:
                try:
                    element = next(source)
                except StopIteration:
                    raise
                except Exception:
                    self._position = position + 1  # the element that raised took its place
                    raise
                self._position = position + 1
                return element
            try:
                source.skip()
            except StopIteration:
                raise
            except Exception:  # noqa: BLE001 - another shard's element: its error is that shard's
                pass
            self._position = position + 1


class EnumerateNode(Node):
    """``(start + i, element)`` pairs."""

    kind = "enumerate"

    def __init__(self, input: Node, start: int) -> None:
        super().__init__(input)
        self.start = start

    def params(self) -> dict[str, Any]:
        return {"start": self.start}

    def build(self, ctx: BuildContext) -> Iterator:
        return EnumerateIterator(self.kind, ctx.build_input(self), self.start)


class EnumerateIterator(PassThroughIterator):
    COUNTERS = ("next_index",)
    COUNTER_MINIMUM = None  # enumerate(start) may start below 0

    def __init__(self, name: str, source: Iterator, start: int) -> None:
        super().__init__(name, source)
        self._next_index = start

    def next(self) -> Any:
        element = next(self._source)
        index = self._next_index
        self._next_index = index + 1
        return index, element


class ScanNode(Node):
    """``fn(state, element) -> (new_state, output)`` carried through the elements."""

    kind = "scan"

    def __init__(self, input: Node, initial_state: Any, fn: Callable[[Any, Any], Any]) -> None:
        super().__init__(input)
        self.initial_state = initial_state
        self.fn = fn
        self.name = f"scan({function_name(fn)})"

    def params(self) -> dict[str, Any]:
        return {"initial_state": self.initial_state, "fn": function_name(self.fn)}

    def build(self, ctx: BuildContext) -> Iterator:
        fn = UserFunction(self.fn, self.name, ctx)
        return ScanIterator(self.name, ctx.build_input(self), fn, self.initial_state)


class ScanIterator(PassThroughIterator):
    COUNTERS = ("seq",)
    STATE = "state"  # the user's scan state: any value, kept as it is

    def __init__(self, name: str, source: Iterator, fn: UserFunction, initial_state: Any) -> None:
        super().__init__(name, source)
        self._fn = fn
        self._state = initial_state
        self._seq = 0

    def next(self) -> Any:
        element = next(self._source)
        seq = self._seq
        self._seq = seq + 1
        result = self._fn(seq, self._state, element)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"{self.name}: fn must return (new_state, output), got {type(result).__name__}")
        self._state, output = result
        return output

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), self.STATE: self._state}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.STATE)
        super().set_state(state)
        self._state = state[self.STATE]


class WithOptionsNode(Node):
    """Sets pipeline options; runs as its input (no iterator of its own)."""

    kind = "with_options"
    checkpoints_as_input = True

    def __init__(self, input: Node, options: Options) -> None:
        super().__init__(input)
        self.options = options

    def params(self) -> dict[str, Any]:
        return {"options": self.options}

    def own_options(self) -> Options:
        return self.options

    def is_asynchronous(self) -> bool:
        return self.inputs[0].is_asynchronous()

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx  # setting options does not move the seeds of what is below

    def build(self, ctx: BuildContext) -> Iterator:
        return ctx.build_input(self)


class ElidedNode(Node):
    """Stands in for ops the optimizer removed as no-ops (``take(-1)``, ``repeat(1)``, ...).

    It has no iterator: building it builds its input, with the context the input had below
    the removed ops, so the seeds of everything underneath stay as written.

    Args:
        hops: the removed nodes, outermost first.
        input: the node below them.
    """

    kind = "elided"
    checkpoints_as_input = True

    def __init__(self, hops: tuple[Node, ...], input: Node) -> None:
        super().__init__(input)
        self.hops = hops

    def label(self) -> str:
        return "elided(" + ", ".join(hop.label() for hop in self.hops) + ")"

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return walk_contexts(self.hops, ctx)

    def elided_context(self, ctx: BuildContext) -> BuildContext:
        return walk_contexts(self.hops, ctx)

    def is_asynchronous(self) -> bool:
        return self.inputs[0].is_asynchronous()

    def build(self, ctx: BuildContext) -> Iterator:
        return ctx.build_input(self)


def walk_contexts(hops: tuple[Node, ...], ctx: BuildContext) -> BuildContext:
    """The context below ``hops`` (outermost first) when the first is built with ``ctx``."""
    for hop in hops:
        ctx = hop.elided_context(ctx)
    return ctx

"""``repeat``: the input again, ``count`` times or forever; and ``shuffle(...).repeat(...)`` fused
(the optimizer's shuffle_repeat_fusion), one shuffle buffer kept across the repetitions."""

from __future__ import annotations

import copy
from typing import Any

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.arguments import require_int
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.ops.shuffle import ShuffleIterator, ShuffleNode


def check_repeat_count(count: Any) -> int:
    """``repeat(count)``'s count as :class:`RepeatNode` takes it: -1 (forever) for None.

    Raises:
        TypeError, ValueError: for a count that is not None or an int >= -1.
    """
    if count is None:
        return -1
    require_int("repeat", "count", count, minimum=-1)
    return count


class RepeatNode(Node):
    """The input ``count`` times over (``-1``: forever); each repetition is a fresh pass."""

    kind = "repeat"
    reorders_only = True

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

    def __init__(self, node: RepeatNode | ShuffleRepeatNode, ctx: BuildContext) -> None:
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
        assert self._source is not None  # advanced when the source ended
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
            return (
                copy.deepcopy(self._final)
                if self._final is not None
                else {self.REPETITION: self._repetition, self.INPUT: None, self.FRESH: self._fresh}
            )
        return {
            self.REPETITION: self._repetition,
            self.INPUT: self._source.state_dict(),
            self.FRESH: self._fresh,
        }

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


class ShuffleRepeatNode(Node):
    """``shuffle(...).repeat(count)`` as one op (made by the optimizer's shuffle_repeat_fusion).

    The output is the unfused pair's, epoch boundaries included (tf.data's semantics): each
    repetition draws with the seed the unfused shuffle would have had in it. One shuffle
    iterator and its buffer are kept for all repetitions instead of being rebuilt each time.
    """

    kind = "shuffle_repeat"
    reorders_only = True

    def __init__(self, shuffle: ShuffleNode, repeat: RepeatNode) -> None:
        super().__init__(*shuffle.inputs)
        self.shuffle = shuffle
        self.repeat = repeat
        self.count = repeat.count

    def label(self) -> str:
        return f"{self.shuffle.label()} + {self.repeat.label()}"

    def cardinality(self) -> int:
        return self.repeat.cardinality()

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return self.repeat.input_context(ctx, 0)  # the shuffle's; each repetition adds its count

    def build(self, ctx: BuildContext) -> Iterator:
        return ShuffleRepeatIterator(self, ctx)


class ShuffleRepeatIterator(RepeatIterator):
    """A repeat whose repetitions all run through one shuffle iterator, rebound each time."""

    _node: ShuffleRepeatNode

    def __init__(self, node: ShuffleRepeatNode, ctx: BuildContext) -> None:
        self._shuffler: ShuffleIterator | None = None
        super().__init__(node, ctx)

    def _make_source(self) -> Iterator:
        shuffle = self._node.shuffle
        shuffle_ctx = self._ctx.repetition(self._repetition)
        source_ctx = shuffle.input_context(shuffle_ctx, 0)
        source = source_ctx.traced(self._node.inputs[0].build(source_ctx))
        seed = shuffle_ctx.op_seed(shuffle.seed, shuffle.reshuffle_each_iteration)
        if self._shuffler is None:
            self._shuffler = shuffle_ctx.traced(
                ShuffleIterator(shuffle.kind, source, shuffle.buffer_size, seed)
            )
        else:
            self._shuffler.rebind(source, seed)
        self.inputs = [self._shuffler]
        return self._shuffler

    def _release(self, source: Iterator) -> None:
        source.inputs[0].close()  # this repetition's input; the shuffle itself is reused

    def shutdown(self) -> None:
        if self._shuffler is not None:
            self._shuffler.close()

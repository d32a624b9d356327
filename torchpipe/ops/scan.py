"""Ops that carry a state along the stream: ``enumerate`` and ``scan``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator, PassThroughIterator
from torchpipe.core.node import BuildContext, Node, function_name
from torchpipe.core.state import check_state


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
            raise TypeError(
                f"{self.name}: fn must return (new_state, output), got {type(result).__name__}"
            )
        self._state, output = result
        return output

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), self.STATE: self._state}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.STATE)
        super().set_state(state)
        self._state = state[self.STATE]

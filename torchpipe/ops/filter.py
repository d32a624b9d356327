"""Ops that drop elements: ``filter``, ``take_while`` and ``ignore_errors``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchpipe.constants import UNKNOWN
from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator, PassThroughIterator
from torchpipe.core.node import BuildContext, Node, function_name
from torchpipe.core.state import check_int, check_state
from torchpipe.errors import UntrustedTypeError


def as_bool(stage: str, value: Any) -> bool:
    """A predicate's result as a bool; only bools and single-element bool tensors/arrays count.

    Raises:
        TypeError: for anything else (tf.data requires a scalar bool too).
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, np.ndarray) and value.dtype == np.bool_ and value.size == 1:
        return bool(value.item())
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1:
        return bool(value.item())
    raise TypeError(
        f"{stage}: the predicate must return a bool, got {type(value).__name__} {value!r}"
    )


class _Dropped:
    """What a fused filter stage returns for an element it drops; pickles by name."""

    def __reduce__(self) -> str:
        return "DROPPED"

    def __repr__(self) -> str:
        return "DROPPED"


DROPPED = _Dropped()


class _PredicateNode(Node):
    def __init__(self, input: Node, predicate: Callable[..., Any]) -> None:
        super().__init__(input)
        self.predicate = predicate
        self.name = f"{self.kind}({function_name(predicate)})"

    def params(self) -> dict[str, Any]:
        return {"predicate": function_name(self.predicate)}

    def cardinality(self) -> int:
        return UNKNOWN


class _PredicateIterator(PassThroughIterator):
    """Base of the predicate ops: numbers input elements and asks the predicate about them."""

    COUNTERS: tuple[str, ...] = ("seq",)

    def __init__(self, name: str, source: Iterator, predicate: UserFunction) -> None:
        super().__init__(name, source)
        self._predicate = predicate
        self._seq = 0

    def _pull(self) -> tuple[Any, bool]:
        element = next(self._source)
        seq = self._seq
        self._seq = seq + 1
        return element, as_bool(self.name, self._predicate.on_element(seq, element))


class FilterNode(_PredicateNode):
    """The elements for which the predicate is True."""

    kind = "filter"
    holds_no_elements = True

    def build(self, ctx: BuildContext) -> Iterator:
        return FilterIterator(
            self.name, ctx.build_input(self), UserFunction(self.predicate, self.name, ctx)
        )


class FilterIterator(_PredicateIterator):
    def next(self) -> Any:
        while True:
            element, keep = self._pull()
            if keep:
                return element


class TakeWhileNode(_PredicateNode):
    """Elements until the first for which the predicate is False."""

    kind = "take_while"

    def build(self, ctx: BuildContext) -> Iterator:
        return TakeWhileIterator(
            self.name, ctx.build_input(self), UserFunction(self.predicate, self.name, ctx)
        )


class TakeWhileIterator(_PredicateIterator):
    COUNTERS = ("seq", "done")

    def __init__(self, name: str, source: Iterator, predicate: UserFunction) -> None:
        super().__init__(name, source, predicate)
        self._done = False

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        element, keep = self._pull()
        if not keep:
            self._done = True
            raise StopIteration
        return element


class IgnoreErrorsNode(Node):
    """The input's elements, skipping those whose computation raised an exception."""

    kind = "ignore_errors"
    holds_no_elements = True

    def cardinality(self) -> int:
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return IgnoreErrorsIterator(self.kind, ctx.build_input(self))


class IgnoreErrorsIterator(Iterator):
    """Counts dropped elements in ``stats.counters['errors_ignored']``."""

    INPUT, IGNORED = "input", "errors_ignored"

    def __init__(self, name: str, source: Iterator) -> None:
        super().__init__(name, source)
        self._source = source
        self.stats.counters[self.IGNORED] = 0

    def next(self) -> Any:
        while True:
            try:
                return next(self._source)
            except (StopIteration, UntrustedTypeError):  # a type to allow, not damaged data
                raise
            except Exception:  # noqa: BLE001 - ignore_errors: counted and dropped
                self.stats.counters[self.IGNORED] += 1

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUT: self._source.state_dict(),
            self.IGNORED: self.stats.counters[self.IGNORED],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, self.IGNORED)
        ignored = check_int(self.name, state, self.IGNORED, minimum=0)
        self._source.load_state_dict(state[self.INPUT])
        self.stats.counters[self.IGNORED] = ignored

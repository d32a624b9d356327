"""Batching ops: ``batch``, ``padded_batch``, ``unbatch`` and ``rebatch``. How elements combine
into a batch lives in ``ops/collate.py``; ``bucket_by_sequence_length`` in ``ops/bucket.py``.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchpipe import nest
from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.arguments import require_bool, require_callable, require_int
from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator, PassThroughIterator
from torchpipe.core.node import BuildContext, Node, function_name
from torchpipe.core.state import check_int, check_state
from torchpipe.errors import CheckpointError
from torchpipe.ops.collate import (
    check_padded_shapes,
    check_padding_values,
    check_padding_values_fit,
    child_paths,
    collate_in_stage,
    padded_collate,
)
from torchpipe.runtime.recycle import RecycledStack

_Combine = Callable[[int, list], Any]


def _batched_cardinality(n: int, batch_size: int, drop_remainder: bool) -> int:
    if n in (INFINITE, UNKNOWN):
        return n
    return n // batch_size if drop_remainder else -(-n // batch_size)


# -- batch and padded_batch -------------------------------------------------------------------
def check_batch_args(op: str, batch_size: Any, drop_remainder: Any, collate_fn: Any = None) -> None:
    """Raise at ``batch(...)`` or ``padded_batch(...)`` (``op``) for a ``batch_size`` that is not
    an int >= 1, a ``drop_remainder`` not a bool or a ``collate_fn`` not None or callable."""
    require_int(op, "batch_size", batch_size, minimum=1)
    require_bool(op, "drop_remainder", drop_remainder)
    if collate_fn is not None:
        require_callable(op, "collate_fn", collate_fn)


class BatchNode(Node):
    """Consecutive elements combined into batches by :func:`collate` or a ``collate_fn``."""

    kind = "batch"
    holds_no_elements = True

    def __init__(
        self,
        input: Node,
        batch_size: int,
        drop_remainder: bool,
        collate_fn: Callable[[list], Any] | None,
    ) -> None:
        super().__init__(input)
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder
        self.collate_fn = collate_fn
        self.name = "batch" if collate_fn is None else f"batch({function_name(collate_fn)})"

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "batch_size": self.batch_size,
            "drop_remainder": self.drop_remainder,
        }
        if self.collate_fn is not None:
            params["collate_fn"] = function_name(self.collate_fn)
        return params

    def cardinality(self) -> int:
        return _batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def build(self, ctx: BuildContext) -> Iterator:
        memory = self.memory()
        combine = self.combiner(ctx, stack=memory or torch.stack)
        # an op may write its result into its row only where it goes to the batch as it is made:
        # not through a shuffle buffer or a cache, which keep it
        lend = self.inputs[0].kind in ("map", "fused_map")
        return BatchIterator(
            self.name,
            ctx.build_input(self),
            self.batch_size,
            self.drop_remainder,
            combine,
            memory,
            lend_rows=lend,
        )

    def memory(self) -> RecycledStack | None:
        """Where the default collation stacks large batches in this process (None with a ``collate_fn``)."""
        return RecycledStack() if self.collate_fn is None else None

    def combiner(self, ctx: BuildContext, stack: Callable[[list], Any] = torch.stack) -> _Combine:
        """``combine(batch_seq, elements)``: the default collation or the user's ``collate_fn``.

        Args:
            stack: how the default collation stacks a component's tensors.
        """
        if self.collate_fn is not None:
            return UserFunction(self.collate_fn, self.name, ctx)
        stage = self.name

        def combine(seq: int, elements: list) -> Any:
            return collate_in_stage(elements, stage, stack)

        return combine


class PaddedBatchNode(Node):
    """Consecutive elements batched with each component padded to a common shape."""

    kind = "padded_batch"
    holds_no_elements = True

    def __init__(
        self,
        input: Node,
        batch_size: int,
        padded_shapes: Any,
        padding_values: Any,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input)
        check_padded_shapes(self.kind, padded_shapes)
        check_padding_values(self.kind, padding_values)
        self.batch_size = batch_size
        self.padded_shapes = padded_shapes
        self.padding_values = padding_values
        self.drop_remainder = drop_remainder

    def params(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "padded_shapes": self.padded_shapes,
            "padding_values": self.padding_values,
            "drop_remainder": self.drop_remainder,
        }

    def cardinality(self) -> int:
        return _batched_cardinality(
            self.inputs[0].cardinality(), self.batch_size, self.drop_remainder
        )

    def build(self, ctx: BuildContext) -> Iterator:
        shapes, pads, stage = self.padded_shapes, self.padding_values, self.kind

        def combine(seq: int, elements: list) -> Any:
            return padded_collate(elements, stage, shapes, pads)

        def check_first(element: Any) -> None:
            check_padding_values_fit(element, stage, pads)

        return BatchIterator(
            stage,
            ctx.build_input(self),
            self.batch_size,
            self.drop_remainder,
            combine,
            check_first=check_first,
        )


class BatchIterator(PassThroughIterator):
    """Pulls ``batch_size`` elements and combines them; nothing is pending between batches.

    Args:
        combine: ``combine(batch_seq, elements)`` makes the batch.
        memory: the stack ``combine`` collates with, whose rows elements are copied to as they
            arrive (None: elements are kept as they are until ``combine``).
        lend_rows: whether ops making the elements may write them into their rows
            (:func:`~torchpipe.runtime.recycle.batch_row`): only where ``source`` is a map run
            on this thread, whose results come here as they are made.
        check_first: called with the pass's first element, to raise before any batch is made
            where the op's arguments do not fit the elements.
    """

    COUNTERS = ("seq",)

    def __init__(
        self,
        name: str,
        source: Iterator,
        batch_size: int,
        drop_remainder: bool,
        combine: _Combine,
        memory: RecycledStack | None = None,
        check_first: Callable[[Any], None] | None = None,
        lend_rows: bool = False,
    ) -> None:
        super().__init__(name, source)
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder
        self._combine = combine
        self._memory = memory
        self._lend_rows = lend_rows
        self._check_first = check_first
        self._seq = 0

    def next(self) -> Any:
        # nothing to place: the input's at once
        if self._memory is None or not self._memory.placing():
            return self._next_batch(_keep)
        with self._memory.rows(self._batch_size, lend=self._lend_rows) as rows:
            return self._next_batch(rows.place)

    def _next_batch(self, place: Callable[[int, Any], Any]) -> Any:
        elements: list[Any] = []
        # nothing to do per element: the input's at once
        if place is _keep and self._check_first is None:
            try:
                elements = self._source.take(self._batch_size)
            except StopIteration:
                raise StopIteration from None
            if self._drop_remainder and len(elements) < self._batch_size:
                raise StopIteration
            seq = self._seq
            self._seq = seq + 1
            return self._combine(seq, elements)
        # a dataset with __getitems__ fetches a batch's elements in one call (placed as they come)
        arriving = (
            self._taken() if getattr(self._source, "fetches_together", False) else self._source
        )
        for element in arriving:
            if self._check_first is not None:
                check, self._check_first = self._check_first, None
                check(element)
            elements.append(place(len(elements), element))
            if len(elements) == self._batch_size:
                break
        if not elements or (self._drop_remainder and len(elements) < self._batch_size):
            raise StopIteration
        seq = self._seq
        self._seq = seq + 1
        return self._combine(seq, elements)

    def _taken(self) -> list[Any]:
        try:
            return self._source.take(self._batch_size)
        except StopIteration:
            return []

    def set_state(self, state: dict[str, Any]) -> None:
        if "pending" in state:  # only a map fused with its batch holds inputs over (map.py)
            raise CheckpointError(
                f"{self.name}: the checkpoint holds inputs left over from an element that failed "
                "in a map fused with this batch; load it with the map_batch_fusion optimization on"
            )
        super().set_state(state)


def _keep(j: int, element: Any) -> Any:
    return element


# -- unbatch and rebatch ----------------------------------------------------------------------
def _is_column_list(x: Any) -> bool:
    """Whether a list is one batched component (strings, numbers, objects), not a structure."""
    return (
        type(x) is list
        and len(x) > 0
        and not any(isinstance(i, (torch.Tensor, np.ndarray)) or nest.is_container(i) for i in x)
    )


def _unstack(x: Any, path: str, stage: str) -> list[Any]:
    """The rows of a batched element: every component split along its first dimension."""
    if _is_column_list(x):
        return list(x)
    if nest.is_container(x):
        paths = child_paths(x, path)
        parts = [_unstack(c, p, stage) for c, p in zip(nest.children(x), paths)]
        if not parts:
            raise ValueError(f"{stage}: {path} has no components to split")
        for p, rows in zip(paths[1:], parts[1:]):
            if len(rows) != len(parts[0]):
                raise ValueError(
                    f"{stage}: components disagree on their first dimension: "
                    f"{paths[0]} has {len(parts[0])}, {p} has {len(rows)}"
                )
        return [nest.rebuild(x, list(row)) for row in zip(*parts)]
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim == 0:
            raise ValueError(f"{stage}: cannot split {path}: it is 0-d (shape ())")
        return list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)
    raise ValueError(
        f"{stage}: cannot split {path} of type {type(x).__name__}: it has no first dimension"
    )


class UnbatchNode(Node):
    """Each element split along its first dimension into elements."""

    kind = "unbatch"

    def cardinality(self) -> int:
        return INFINITE if self.inputs[0].cardinality() == INFINITE else UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return UnbatchIterator(self.kind, ctx.build_input(self))


class UnbatchIterator(Iterator):
    """Yields the rows of each input element in order.

    Its checkpoint is small: the input's state before the element being split plus how many
    of its rows were consumed; a resume re-reads that element and skips them.
    """

    INPUT, OFFSET = "input", "offset"

    def __init__(self, name: str, source: Iterator) -> None:
        super().__init__(name, source)
        self._source = source
        self._rows: list[Any] = []
        self._offset = 0
        self._before: dict[str, Any] | None = None
        self._skip = 0  # rows of the next element consumed before a resume

    def next(self) -> Any:
        while self._offset >= len(self._rows):
            self._pull()
        row = self._rows[self._offset]
        self._offset += 1
        return row

    def _pull(self) -> None:
        before = self._source.state_dict()
        element = next(self._source)
        rows = _unstack(element, "element", self.name)
        skip, self._skip = self._skip, 0
        if skip > len(rows):
            raise CheckpointError(
                f"{self.name}: cannot resume: the checkpoint skips {skip} rows of an element that now has {len(rows)}"
            )
        self._before, self._rows, self._offset = before, rows, skip

    def get_state(self) -> dict[str, Any]:
        if self._offset < len(self._rows):
            return {self.INPUT: copy.deepcopy(self._before), self.OFFSET: self._offset}
        return {self.INPUT: self._source.state_dict(), self.OFFSET: self._skip}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, self.OFFSET)
        skip = check_int(self.name, state, self.OFFSET, minimum=0)
        self._source.load_state_dict(state[self.INPUT])
        self._skip = skip


def check_rebatch_args(batch_size: Any, drop_remainder: Any) -> list[int]:
    """Raise at ``rebatch(...)`` for a ``batch_size`` that is not an int >= 1 or a non-empty list
    of them, or a ``drop_remainder`` not a bool.

    Returns:
        The batch sizes, a list of ints.
    """
    sizes = [batch_size] if isinstance(batch_size, numbers.Integral) else batch_size
    if not isinstance(sizes, Sequence) or isinstance(sizes, str) or not sizes:
        raise TypeError(
            f"rebatch: batch_size must be an int or a non-empty list of ints, got {batch_size!r}"
        )
    for size in sizes:
        require_int("rebatch", "batch_size", size, minimum=1)
    require_bool("rebatch", "drop_remainder", drop_remainder)
    return [int(s) for s in sizes]


class RebatchNode(Node):
    """Batched elements re-split into batches of the given sizes, used in turn.

    The same as ``unbatch().batch(size)`` when there is one size. tf.data reports an unknown
    cardinality for an infinite input; this reports ``INFINITE``, as unbatch + batch would.
    """

    kind = "rebatch"

    def __init__(self, input: Node, batch_sizes: list[int], drop_remainder: bool) -> None:
        super().__init__(input)
        self.batch_sizes = list(batch_sizes)
        self.drop_remainder = drop_remainder

    def params(self) -> dict[str, Any]:
        return {"batch_sizes": self.batch_sizes, "drop_remainder": self.drop_remainder}

    def cardinality(self) -> int:
        return INFINITE if self.inputs[0].cardinality() == INFINITE else UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return RebatchIterator(
            self.kind, ctx.build_input(self), self.batch_sizes, self.drop_remainder
        )


class RebatchIterator(UnbatchIterator):
    """Collects the input's rows into batches of the next size in the cycle."""

    SIZE_INDEX = "size_index"

    def __init__(
        self, name: str, source: Iterator, batch_sizes: list[int], drop_remainder: bool
    ) -> None:
        super().__init__(name, source)
        self._sizes = batch_sizes
        self._drop_remainder = drop_remainder
        self._size_index = 0

    def next(self) -> Any:
        size = self._sizes[self._size_index]
        rows: list[Any] = []
        while len(rows) < size:
            try:
                rows.append(super().next())
            except StopIteration:
                break
        if not rows or (self._drop_remainder and len(rows) < size):
            raise StopIteration
        self._size_index = (self._size_index + 1) % len(self._sizes)
        return collate_in_stage(rows, self.name)

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), self.SIZE_INDEX: self._size_index}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.SIZE_INDEX)
        size_index = check_int(
            self.name, state, self.SIZE_INDEX, minimum=0, maximum=len(self._sizes) - 1
        )
        super().set_state(state)
        self._size_index = size_index

"""``bucket_by_sequence_length``: elements grouped by length into buckets, each full bucket
emitted as a padded batch (tf.data's op). The padding is ``padded_batch``'s (``ops/collate.py``).
"""

from __future__ import annotations

import bisect
import itertools
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.arguments import require_bool, require_callable, require_int
from torchpipe.core.function import UserFunction
from torchpipe.core.held_elements import HeldStructure
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node, function_name
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.errors import CheckpointError
from torchpipe.ops.collate import (
    check_padded_shapes,
    check_padding_values,
    check_padding_values_fit,
    padded_collate,
)


def check_bucket_args(
    element_length_func: Any,
    bucket_boundaries: Any,
    bucket_batch_sizes: Any,
    pad_to_bucket_boundary: Any,
    drop_remainder: Any,
) -> tuple[list[int], list[int]]:
    """Raise at ``bucket_by_sequence_length(...)`` for an argument of the wrong type or range:
    boundaries that are not ints >= 1 in increasing order, batch sizes that are not ints >= 1, one
    more than the boundaries.

    Returns:
        The boundaries and the batch sizes, as lists.
    """
    require_callable("bucket_by_sequence_length", "element_length_func", element_length_func)
    bounds = list(bucket_boundaries)
    sizes = list(bucket_batch_sizes)
    for b in bounds:
        require_int("bucket_by_sequence_length", "bucket_boundaries", b, minimum=1)
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"bucket_by_sequence_length: bucket_boundaries must increase, got {bounds}"
        )
    for s in sizes:
        require_int("bucket_by_sequence_length", "bucket_batch_sizes", s, minimum=1)
    if len(sizes) != len(bounds) + 1:
        raise ValueError(
            f"bucket_by_sequence_length: len(bucket_batch_sizes) must be len(bucket_boundaries) + 1, "
            f"got {len(sizes)} and {len(bounds)}"
        )
    require_bool("bucket_by_sequence_length", "pad_to_bucket_boundary", pad_to_bucket_boundary)
    require_bool("bucket_by_sequence_length", "drop_remainder", drop_remainder)
    return bounds, sizes


class BucketBySequenceLengthNode(Node):
    """Elements grouped by length into buckets, each full bucket emitted as a padded batch.

    tf.data's algorithm: bucket ``i`` takes lengths in ``[bucket_boundaries[i-1],
    bucket_boundaries[i])`` (the last one everything above); a bucket that reaches
    ``bucket_batch_sizes[i]`` elements is emitted at once, and at the end of the input the
    partial buckets are emitted in ascending bucket order (dropped with ``drop_remainder``).

    ``pad_to_bucket_boundary``: tf pads its statically unknown dimensions to
    ``bucket_boundary - 1``. torchpipe has no static shapes, so without ``padded_shapes``
    dimension 0 of every tensor/array component is padded to ``bucket_boundary - 1`` and the
    other dimensions to the batch maximum; with ``padded_shapes``, its ``None``/-1 dimensions
    get ``bucket_boundary - 1``. A length >= ``max(bucket_boundaries)`` is then a ValueError
    as soon as the element arrives (tf fails only when that bucket's batch is formed).
    """

    kind = "bucket_by_sequence_length"

    def __init__(
        self,
        input: Node,
        element_length_func: Callable[..., int],
        bucket_boundaries: list[int],
        bucket_batch_sizes: list[int],
        padded_shapes: Any,
        padding_values: Any,
        pad_to_bucket_boundary: bool,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input)
        check_padded_shapes(self.kind, padded_shapes)
        check_padding_values(self.kind, padding_values)
        self.element_length_func = element_length_func
        self.bucket_boundaries = list(bucket_boundaries)
        self.bucket_batch_sizes = list(bucket_batch_sizes)
        self.padded_shapes = padded_shapes
        self.padding_values = padding_values
        self.pad_to_bucket_boundary = pad_to_bucket_boundary
        self.drop_remainder = drop_remainder
        self.name = f"{self.kind}({function_name(element_length_func)})"

    def params(self) -> dict[str, Any]:
        return {
            "element_length_func": function_name(self.element_length_func),
            "bucket_boundaries": self.bucket_boundaries,
            "bucket_batch_sizes": self.bucket_batch_sizes,
            "padded_shapes": self.padded_shapes,
            "padding_values": self.padding_values,
            "pad_to_bucket_boundary": self.pad_to_bucket_boundary,
            "drop_remainder": self.drop_remainder,
        }

    def cardinality(self) -> int:
        return INFINITE if self.inputs[0].cardinality() == INFINITE else UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        length_fn = UserFunction(self.element_length_func, self.name, ctx)
        return BucketIterator(self, ctx.build_input(self), length_fn)


class BucketIterator(Iterator):
    """Fills the buckets and emits them; the partial buckets are its (unavoidable) state."""

    INPUT, SEQ, BUCKETS, ENDED, STRUCTURE = "input", "seq", "buckets", "ended", "structure"

    def __init__(
        self, node: BucketBySequenceLengthNode, source: Iterator, length_fn: UserFunction
    ) -> None:
        super().__init__(node.name, source)
        self._node = node
        self._source = source
        self._length_fn = length_fn
        self._buckets: list[list[Any]] = [[] for _ in node.bucket_batch_sizes]
        self._held = HeldStructure()  # what the buckets' elements share, checked at a resume
        self._seq = 0
        self._ended = False
        self._checked = False  # padding_values against the pass's first element

    def next(self) -> Any:
        node = self._node
        while not self._ended:
            try:
                element = next(self._source)
            except StopIteration:
                self._ended = True
                break
            if not self._checked:
                self._checked = True
                check_padding_values_fit(element, self.name, node.padding_values)
            bucket_id = self._bucket_of(element)
            bucket = self._buckets[bucket_id]
            self._held.add(element)
            bucket.append(element)
            if len(bucket) == node.bucket_batch_sizes[bucket_id]:
                return self._emit(bucket_id)
        for bucket_id, bucket in enumerate(self._buckets):
            if bucket:
                if node.drop_remainder:
                    self._buckets[bucket_id] = []
                    continue
                return self._emit(bucket_id)
        raise StopIteration

    def _bucket_of(self, element: Any) -> int:
        seq = self._seq
        self._seq = seq + 1
        length = _as_length(self._length_fn.on_element(seq, element), self.name)
        bounds = self._node.bucket_boundaries
        if self._node.pad_to_bucket_boundary and length >= bounds[-1]:
            raise ValueError(
                f"{self.name}: element {seq} has length {length}; with pad_to_bucket_boundary=True "
                f"lengths must be < max(bucket_boundaries) = {bounds[-1]}"
            )
        return bisect.bisect_right(bounds, length)

    def _emit(self, bucket_id: int) -> Any:
        elements, self._buckets[bucket_id] = self._buckets[bucket_id], []
        node = self._node
        boundary = node.bucket_boundaries[bucket_id] - 1 if node.pad_to_bucket_boundary else None
        return padded_collate(
            elements, self.name, node.padded_shapes, node.padding_values, boundary
        )

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUT: self._source.state_dict(),
            self.SEQ: self._seq,
            self.BUCKETS: [list(bucket) for bucket in self._buckets],
            self.ENDED: self._ended,
            self.STRUCTURE: self._held.state(itertools.chain.from_iterable(self._buckets)),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, self.SEQ, self.BUCKETS, self.ENDED)
        buckets = state[self.BUCKETS]
        if len(buckets) != len(self._buckets):
            raise CheckpointError(
                f"{self.name}: the checkpoint has {len(buckets)} buckets, not {len(self._buckets)}"
            )
        seq, ended = (
            check_int(self.name, state, self.SEQ, minimum=0),
            check_bool(self.name, state, self.ENDED),
        )
        held = list(itertools.chain.from_iterable(buckets))
        self._held.load(self.name, self.BUCKETS, held, state.get(self.STRUCTURE))
        self._source.load_state_dict(state[self.INPUT])
        self._seq = seq
        self._buckets = [list(bucket) for bucket in buckets]
        self._ended = ended


def _as_length(value: Any, stage: str) -> int:
    """``element_length_func``'s result as an int (an int, or a 0-d integer tensor or array)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    ):
        return int(value)
    raise TypeError(
        f"{stage}: element_length_func must return an int, got {type(value).__name__} {value!r}"
    )

"""Ops that combine datasets: ``zip``, ``concatenate``, ``choose_from_datasets`` and
``sample_from_datasets``."""

from __future__ import annotations

import bisect
import copy
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchpipe import nest
from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.ops.shuffle import copy_rng_state


def _describe_structure(structure: Any) -> str:
    """A short text of a zip structure with its datasets shown as ``*``."""
    if structure is None:
        return "tuple"
    return repr(nest.map_structure(lambda _: _Star(), structure))


class _Star:
    def __repr__(self) -> str:
        return "*"


class ZipNode(Node):
    """Elements of several inputs side by side, until the shortest ends.

    Args:
        inputs: the input nodes, in the order of ``structure``'s leaves.
        structure: ``None`` for plain tuples, or the nesting of datasets given to ``tp.zip``
            (tuples, dicts, namedtuples) whose shape every element takes.
    """

    kind = "zip"

    def __init__(self, inputs: list[Node], structure: Any) -> None:
        super().__init__(*inputs)
        places = len(inputs) if structure is None else len(nest.flatten(structure))
        if places != len(inputs):
            raise ValueError(f"zip: the structure has {places} datasets, got {len(inputs)} inputs")
        # Keep only the shape, not the user's Dataset objects. A lone Dataset as the
        # structure is a leaf: its elements come out unwrapped, as in tf.data.
        shape = tuple(inputs) if structure is None else structure
        self.template = nest.map_structure(lambda _: None, shape)
        self._text = _describe_structure(structure)

    def params(self) -> dict[str, Any]:
        return {"datasets": len(self.inputs), "structure": self._text}

    def cardinality(self) -> int:
        counts = [node.cardinality() for node in self.inputs]
        if UNKNOWN in counts:
            return UNKNOWN
        finite = [n for n in counts if n != INFINITE]
        return min(finite) if finite else INFINITE

    def build(self, ctx: BuildContext) -> Iterator:
        sources = [ctx.build_input(self, i) for i in range(len(self.inputs))]
        flat = type(self.template) is tuple and not any(nest.is_container(c) for c in self.template)
        return ZipIterator(self.kind, sources, self.template, flat)


class ZipIterator(Iterator):
    """Takes one element from each input per step; ends for good when any input ends.

    Args:
        name: the stage name.
        sources: the input iterators.
        template: the structure to pack each step's elements into.
        flat: whether ``template`` is a plain tuple of leaves (packed without ``nest``).
    """

    INPUTS, DONE = "inputs", "done"

    def __init__(self, name: str, sources: list[Iterator], template: Any, flat: bool) -> None:
        super().__init__(name, *sources)
        self._template = template
        self._flat = flat
        self._done = False

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            elements = [next(source) for source in self.inputs]
        except StopIteration:
            self._done = True
            raise
        return tuple(elements) if self._flat else nest.pack_as(self._template, elements)

    def get_state(self) -> dict[str, Any]:
        return {self.INPUTS: [source.state_dict() for source in self.inputs], self.DONE: self._done}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUTS, self.DONE)
        done = check_bool(self.name, state, self.DONE)
        _load_all(self.name, self.inputs, state[self.INPUTS])
        self._done = done


def _load_all(name: str, sources: Sequence[Iterator | None], states: list[Any]) -> None:
    """Load one state per input, skipping inputs that are gone or were saved as exhausted."""
    if len(states) != len(sources):
        raise TypeError(f"{name}: state has {len(states)} inputs, the pipeline has {len(sources)}")
    for source, state in zip(sources, states):
        if source is not None and state is not None:
            source.load_state_dict(state)


class ConcatenateNode(Node):
    """The elements of ``a`` followed by those of ``b``."""

    kind = "concatenate"

    def __init__(self, a: Node, b: Node) -> None:
        super().__init__(a, b)

    def cardinality(self) -> int:
        counts = [node.cardinality() for node in self.inputs]
        if INFINITE in counts:
            return INFINITE
        if UNKNOWN in counts:
            return UNKNOWN
        return sum(counts)

    def build(self, ctx: BuildContext) -> Iterator:
        return ConcatenateIterator(self, ctx)


class ConcatenateIterator(Iterator):
    """Runs the first input to its end, then the second.

    Both are built at once (an iterator does nothing before its first element) so that every
    state holds both inputs' states, but only the running one is a child (stats, the tuner);
    the first is closed as soon as it ends, and its state at its end is what the checkpoint
    keeps of it from then on.
    """

    INDEX, INPUTS = "index", "inputs"

    def __init__(self, node: ConcatenateNode, ctx: BuildContext) -> None:
        super().__init__(node.kind, ctx.build_input(node, 0), ctx.build_input(node, 1))
        self._index = 0  # the input running now; 2 once both ended
        self._first_ended: dict[str, Any] | None = None

    def children(self) -> list[Iterator]:
        return self.inputs[self._index : self._index + 1]

    def shutdown(self) -> None:
        for source in self.inputs:
            source.close()

    def next(self) -> Any:
        while self._index < 2:
            try:
                return next(self.inputs[self._index])
            except StopIteration:
                if self._index == 0:
                    self._first_ended = self.inputs[0].state_dict()
                    self.inputs[0].close()
                self._index += 1
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        first = (
            self.inputs[0].state_dict() if self._index == 0 else copy.deepcopy(self._first_ended)
        )
        return {self.INDEX: self._index, self.INPUTS: [first, self.inputs[1].state_dict()]}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INDEX, self.INPUTS)
        index = check_int(self.name, state, self.INDEX, minimum=0, maximum=2)
        first, second = state[self.INPUTS]
        if index == 0:
            self.inputs[0].load_state_dict(first)
        else:
            self._first_ended = copy.deepcopy(first)
            self.inputs[0].close()
        self.inputs[1].load_state_dict(second)
        self._index = index


def _interleave_cardinality(inputs: list[Node]) -> int:
    """tf.data's rule for a directed interleave: endless if any input is, else unknown."""
    return INFINITE if any(node.cardinality() == INFINITE for node in inputs) else UNKNOWN


class _DirectedIterator(Iterator):
    """Base of choose/sample: reads the input a selector names; exhausted inputs are dropped.

    Args:
        name: the stage name.
        sources: the data inputs; ``None`` for an input that will never be read.
        stop_on_empty: end when the selected input is exhausted, instead of dropping it.
    """

    INPUTS, DONE = "inputs", "done"

    def __init__(self, name: str, sources: list[Iterator | None], stop_on_empty: bool) -> None:
        super().__init__(name)
        self._sources = sources
        self._stop_on_empty = stop_on_empty
        self._done = False

    def children(self) -> list[Iterator]:
        return [source for source in self._sources if source is not None]

    def _read(self, index: int) -> tuple[bool, Any]:
        """``(True, element)`` from input ``index``, or ``(False, None)`` if it is exhausted."""
        source = self._sources[index]
        if source is not None:
            try:
                return True, next(source)
            except StopIteration:
                source.close()
                self._sources[index] = None
                self._on_exhausted(index)
        if self._stop_on_empty:
            self._done = True
            raise StopIteration
        return False, None

    def _on_exhausted(self, index: int) -> None:
        """Hook for subclasses that track which inputs are left."""

    def _input_states(self) -> list[Any]:
        return [None if source is None else source.state_dict() for source in self._sources]

    def _load_inputs(self, states: list[Any]) -> None:
        _load_all(self.name, self._sources, states)
        for i, state in enumerate(states):
            source = self._sources[i]
            if state is None and source is not None:
                source.close()
                self._sources[i] = None


class ChooseFromDatasetsNode(Node):
    """For each value ``c`` of ``choice``, the next element of ``inputs[c]``.

    Args:
        inputs: the data inputs.
        choice: yields integer scalars in ``[0, len(inputs))``.
        stop_on_empty_dataset: end when a chosen input is exhausted; if False such choices
            are skipped, and the op ends when every input is exhausted.
    """

    kind = "choose_from_datasets"

    def __init__(self, inputs: list[Node], choice: Node, stop_on_empty_dataset: bool) -> None:
        super().__init__(*inputs, choice)
        self.num_inputs = len(inputs)
        self.stop_on_empty_dataset = stop_on_empty_dataset

    def params(self) -> dict[str, Any]:
        return {"datasets": self.num_inputs, "stop_on_empty_dataset": self.stop_on_empty_dataset}

    def cardinality(self) -> int:
        return _interleave_cardinality(list(self.inputs[: self.num_inputs]))

    def build(self, ctx: BuildContext) -> Iterator:
        sources: list[Iterator | None] = [ctx.build_input(self, i) for i in range(self.num_inputs)]
        choice = ctx.build_input(self, self.num_inputs)
        return ChooseIterator(self.kind, sources, choice, self.stop_on_empty_dataset)


class ChooseIterator(_DirectedIterator):
    """Reads the choice input and takes the next element of the input it names."""

    CHOICE, SEQ = "choice", "seq"

    def __init__(
        self, name: str, sources: list[Iterator | None], choice: Iterator, stop_on_empty: bool
    ) -> None:
        super().__init__(name, sources, stop_on_empty)
        self._choice = choice
        self._seq = 0  # choice elements read

    def children(self) -> list[Iterator]:
        return [*super().children(), self._choice]

    def next(self) -> Any:
        while not self._done and any(source is not None for source in self._sources):
            value = next(self._choice)
            seq = self._seq
            self._seq = seq + 1
            found, element = self._read(choice_index(self.name, value, len(self._sources), seq))
            if found:
                return element
        self._done = True
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUTS: self._input_states(),
            self.CHOICE: self._choice.state_dict(),
            self.SEQ: self._seq,
            self.DONE: self._done,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUTS, self.CHOICE, self.SEQ, self.DONE)
        seq, done = (
            check_int(self.name, state, self.SEQ, minimum=0),
            check_bool(self.name, state, self.DONE),
        )
        self._load_inputs(state[self.INPUTS])
        self._choice.load_state_dict(state[self.CHOICE])
        self._seq, self._done = seq, done


def choice_index(stage: str, value: Any, n: int, seq: int) -> int:
    """A choice element as an input index.

    Raises:
        TypeError: unless ``value`` is an integer scalar (int, numpy integer, 0-d integer
            tensor or array).
        ValueError: unless ``0 <= value < n``.
    """
    index = _as_int(value)
    if index is None:
        raise TypeError(
            f"{stage}: choice element {seq} must be an integer scalar, got {type(value).__name__} {value!r}"
        )
    if not 0 <= index < n:
        raise ValueError(f"{stage}: choice element {seq} is {index}, out of range for {n} datasets")
    return index


def _as_int(value: Any) -> int | None:
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, torch.Tensor):
        integral = not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
        )
        return int(value.item()) if value.ndim == 0 and integral else None
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value.item())
    return None


class SampleFromDatasetsNode(Node):
    """Elements drawn at random from the inputs with fixed probabilities.

    Inputs of weight 0 are never built or read (tf.data drops them too).

    Args:
        inputs: the data inputs.
        weights: one probability per input, summing to 1.
        seed: the op's own seed; ``None`` derives one from the pipeline seed and its position.
        stop_on_empty_dataset: end when the drawn input is exhausted; if False it is dropped
            and the remaining weights renormalized.
    """

    kind = "sample_from_datasets"

    def __init__(
        self,
        inputs: list[Node],
        weights: list[float],
        seed: int | None,
        stop_on_empty_dataset: bool,
    ) -> None:
        super().__init__(*inputs)
        if len(weights) != len(inputs):
            raise ValueError(
                f"sample_from_datasets: expected {len(inputs)} weights, got {len(weights)}"
            )
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"sample_from_datasets: weights must be non-negative with a positive sum, got {weights}"
            )
        self.weights = [float(w) for w in weights]
        self.seed = seed
        self.stop_on_empty_dataset = stop_on_empty_dataset

    def params(self) -> dict[str, Any]:
        return {
            "weights": [round(w, 4) for w in self.weights],
            "seed": self.seed,
            "stop_on_empty_dataset": self.stop_on_empty_dataset,
        }

    def cardinality(self) -> int:
        drawn = [node for node, w in zip(self.inputs, self.weights) if w > 0]
        # A single input that can be drawn is passed through whole, whatever the stop rule.
        return drawn[0].cardinality() if len(drawn) == 1 else _interleave_cardinality(drawn)

    def build(self, ctx: BuildContext) -> Iterator:
        sources = [ctx.build_input(self, i) if w > 0 else None for i, w in enumerate(self.weights)]
        seed = ctx.op_seed(self.seed, reshuffle=False)
        return SampleIterator(self.kind, sources, self.weights, seed, self.stop_on_empty_dataset)


class SampleIterator(_DirectedIterator):
    """Draws an input index with the weights of the inputs not yet exhausted."""

    RNG = "rng"

    def __init__(
        self,
        name: str,
        sources: list[Iterator | None],
        weights: list[float],
        seed: int,
        stop_on_empty: bool,
    ) -> None:
        super().__init__(name, sources, stop_on_empty)
        self._weights = weights
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._cumulative: list[float] = []
        self._last = -1
        self._reweigh()

    def _reweigh(self) -> None:
        """Cumulative weights over the live inputs; exhausted ones get an empty interval."""
        live = [w if source is not None else 0.0 for w, source in zip(self._weights, self._sources)]
        self._cumulative = list(itertools.accumulate(live))
        self._last = max((i for i, w in enumerate(live) if w > 0), default=-1)

    def _on_exhausted(self, index: int) -> None:
        self._reweigh()

    def _draw(self) -> int:
        u = self._rng.random() * self._cumulative[-1]
        # bisect_right never lands on a zero-width interval; rounding can only overshoot.
        return min(bisect.bisect_right(self._cumulative, u), self._last)

    def next(self) -> Any:
        while not self._done and self._last >= 0:
            found, element = self._read(self._draw())
            if found:
                return element
        self._done = True
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUTS: self._input_states(),
            self.RNG: copy_rng_state(self._rng.bit_generator.state),
            self.DONE: self._done,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUTS, self.RNG, self.DONE)
        done = check_bool(self.name, state, self.DONE)
        self._load_inputs(state[self.INPUTS])
        self._rng.bit_generator.state = copy_rng_state(state[self.RNG])
        self._done = done
        self._reweigh()

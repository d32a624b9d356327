"""``shuffle``: tf.data's buffer shuffle, reproducible from a seed and checkpointable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from torchpipe.core.arguments import require_bool, require_int, require_seed
from torchpipe.core.held_elements import HeldStructure
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_bool, check_state
from torchpipe.errors import CheckpointError


def check_shuffle_args(buffer_size: Any, seed: Any, reshuffle_each_iteration: Any) -> None:
    """Raise at ``shuffle(...)`` for a ``buffer_size`` that is not an int >= 1, a ``seed`` not
    None or an int >= 0, or a ``reshuffle_each_iteration`` not a bool."""
    require_int("shuffle", "buffer_size", buffer_size, minimum=1)
    require_seed("shuffle", seed)
    require_bool("shuffle", "reshuffle_each_iteration", reshuffle_each_iteration)


class ShuffleNode(Node):
    """The input's elements in a random order drawn from a buffer of ``buffer_size`` elements.

    Args:
        input: the node to shuffle.
        buffer_size: how many elements the buffer holds (1 keeps the input order).
        seed: the op's own seed; ``None`` derives one from the pipeline seed and its position.
        reshuffle_each_iteration: draw a new order every epoch and every enclosing repetition.
    """

    kind = "shuffle"
    reorders_only = True

    def __init__(
        self, input: Node, buffer_size: int, seed: int | None, reshuffle_each_iteration: bool
    ) -> None:
        super().__init__(input)
        self.buffer_size = int(buffer_size)
        self.seed = seed
        self.reshuffle_each_iteration = reshuffle_each_iteration

    def params(self) -> dict[str, Any]:
        return {
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "reshuffle_each_iteration": self.reshuffle_each_iteration,
        }

    def build(self, ctx: BuildContext) -> Iterator:
        seed = ctx.op_seed(self.seed, self.reshuffle_each_iteration)
        return ShuffleIterator(self.kind, ctx.build_input(self), self.buffer_size, seed)


class ShuffleIterator(Iterator):
    """Keeps the buffer full and hands out a uniformly chosen element of it each step.

    Once the input ends the buffer drains in random order. An element can come out at most
    ``buffer_size - 1`` positions earlier than it went in. The buffer itself is part of the
    checkpoint; that is unavoidable for a streaming shuffle. So is the structure its elements
    share (``held_elements.py``), against which a loaded buffer is checked.

    Args:
        name: the stage name.
        source: the input iterator.
        buffer_size: the buffer's capacity.
        seed: the seed of this pass's random draws.
    """

    INPUT, BUFFER, RNG, INPUT_DONE, STRUCTURE = "input", "buffer", "rng", "input_done", "structure"

    def __init__(self, name: str, source: Iterator, buffer_size: int, seed: int) -> None:
        super().__init__(name, source)
        self._source = source
        self._capacity = buffer_size
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._buffer: list[Any] = []
        self._held = HeldStructure()
        self._input_done = False

    def rebind(self, source: Iterator, seed: int) -> None:
        """Start over on a new input with a new seed, keeping the (drained) buffer."""
        self._source = source
        self.inputs = [source]
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._input_done = False

    def _fill(self) -> None:
        if not self._input_done:
            self._input_done = self._held.fill(self._buffer, self._source, self._capacity)

    def next(self) -> Any:
        self._fill()
        buffer = self._buffer
        n = len(buffer)
        if n == 0:
            raise StopIteration
        # Moving the last element into the chosen slot keeps removal O(1); the draw is
        # uniform over the buffer whatever the slots' order, so the distribution is tf's.
        i = int(self._rng.integers(n)) if n > 1 else 0
        element = buffer[i]
        buffer[i] = buffer[-1]
        buffer.pop()
        return element

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUT: self._source.state_dict(),
            self.BUFFER: list(self._buffer),
            self.RNG: copy_rng_state(self._rng.bit_generator.state),
            self.INPUT_DONE: self._input_done,
            self.STRUCTURE: self._held.state(self._buffer),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, self.BUFFER, self.RNG, self.INPUT_DONE)
        buffer, input_done = state[self.BUFFER], check_bool(self.name, state, self.INPUT_DONE)
        if not isinstance(buffer, list) or len(buffer) > self._capacity:
            raise CheckpointError(
                f"{self.name}: state['buffer'] must be a list of at most {self._capacity} elements"
            )
        self._held.load(self.name, self.BUFFER, buffer, state.get(self.STRUCTURE))
        self._source.load_state_dict(state[self.INPUT])
        self._buffer = list(buffer)
        self._rng.bit_generator.state = copy_rng_state(state[self.RNG])
        self._input_done = input_done

    def shutdown(self) -> None:
        self._buffer = []


def copy_rng_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a bit generator's state dict (it nests a dict, which must not be shared)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}

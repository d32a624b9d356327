"""``window``: tf.data's sliding windows over consecutive elements, each yielded as a tuple."""

from __future__ import annotations

from typing import Any

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.arguments import require_bool, require_int
from torchpipe.core.held_elements import HeldStructure
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.errors import CheckpointError


def check_window_args(
    size: Any, shift: Any, stride: Any, drop_remainder: Any
) -> tuple[int, int, int]:
    """Raise at ``window(...)`` for a ``size``, ``shift`` (None: ``size``) or ``stride`` that is
    not an int >= 1, or a ``drop_remainder`` not a bool.

    Returns:
        ``size``, ``shift`` and ``stride`` as :class:`WindowNode` takes them: ints.
    """
    require_int("window", "size", size, minimum=1)
    if shift is not None:
        require_int("window", "shift", shift, minimum=1)
    require_int("window", "stride", stride, minimum=1)
    require_bool("window", "drop_remainder", drop_remainder)
    return int(size), int(size if shift is None else shift), int(stride)


class WindowNode(Node):
    """Windows of ``size`` elements, one starting every ``shift`` input elements, every
    ``stride``-th element taken within a window.

    Args:
        input: the node to window.
        size: elements in a full window.
        shift: input elements from one window's start to the next's.
        stride: input elements from one element of a window to the next.
        drop_remainder: leave out the windows that the input's end cuts short.
    """

    kind = "window"

    def __init__(
        self, input: Node, size: int, shift: int, stride: int, drop_remainder: bool
    ) -> None:
        super().__init__(input)
        self.size = size
        self.shift = shift
        self.stride = stride
        self.drop_remainder = drop_remainder

    def params(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "shift": self.shift,
            "stride": self.stride,
            "drop_remainder": self.drop_remainder,
        }

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        if not self.drop_remainder:
            return -(-n // self.shift)  # a window starts at every multiple of shift below n
        span = (self.size - 1) * self.stride + 1
        return 0 if n < span else (n - span) // self.shift + 1

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        return WindowIterator(
            self.kind, source, self.size, self.shift, self.stride, self.drop_remainder
        )


class WindowIterator(Iterator):
    """Keeps the input elements one window spans, ``(size - 1) * stride + 1``, and hands out
    every ``stride``-th of them as a tuple; then drops ``shift`` of them.

    Where ``shift`` is larger than the span, the input elements between two windows are
    skipped when the next window is asked for (without being read where the input can seek;
    an error one of them raises is dropped, as tf.data drops it: no window holds it). The
    elements held are part of the checkpoint, checked at load against the structure they share
    (``core/held_elements.py``), as a shuffle buffer is.

    Args:
        name: the stage name.
        source: the input iterator.
        size, shift, stride, drop_remainder: as :class:`WindowNode`'s.
    """

    INPUT, BUFFER, SKIP, INPUT_DONE, STRUCTURE = (
        "input",
        "buffer",
        "skip",
        "input_done",
        "structure",
    )

    def __init__(
        self, name: str, source: Iterator, size: int, shift: int, stride: int, drop_remainder: bool
    ) -> None:
        super().__init__(name, source)
        self._source = source
        self._span = (size - 1) * stride + 1
        self._shift = shift
        self._stride = stride
        self._drop_remainder = drop_remainder
        self._buffer: list[Any] = []
        self._skip = 0  # input elements between the last window's span and the next window's start
        self._input_done = False
        self._held = HeldStructure()

    def next(self) -> tuple[Any, ...]:
        self._skip_gap()
        self._fill()
        buffer = self._buffer
        if not buffer or (self._drop_remainder and len(buffer) < self._span):
            self._buffer = []
            raise StopIteration
        window = tuple(buffer[:: self._stride])
        if self._shift < len(buffer):
            del buffer[: self._shift]
        else:
            self._skip = 0 if self._input_done else self._shift - len(buffer)
            self._buffer = []
        return window

    def _skip_gap(self) -> None:
        while self._skip and not self._input_done:
            self._skip -= 1
            try:
                self._source.skip()
            except StopIteration:
                self._input_done = True
            except Exception:  # noqa: BLE001 - an element no window holds: its error reaches no one
                pass
        self._skip = 0

    def _fill(self) -> None:
        if not self._input_done:
            self._input_done = self._held.fill(self._buffer, self._source, self._span)

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUT: self._source.state_dict(),
            self.BUFFER: list(self._buffer),
            self.SKIP: self._skip,
            self.INPUT_DONE: self._input_done,
            self.STRUCTURE: self._held.state(self._buffer),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(
            self.name, state, self.INPUT, self.BUFFER, self.SKIP, self.INPUT_DONE, self.STRUCTURE
        )
        buffer, input_done = state[self.BUFFER], check_bool(self.name, state, self.INPUT_DONE)
        skip = check_int(
            self.name, state, self.SKIP, minimum=0, maximum=max(self._shift - self._span, 0)
        )
        if not isinstance(buffer, list) or len(buffer) > self._span or (skip and buffer):
            raise CheckpointError(
                f"{self.name}: state['buffer'] must be a list of at most {self._span} elements, "
                "empty while input elements are to be skipped"
            )
        structure = state[self.STRUCTURE]
        # a state this op made records the structure of what it holds
        if structure is None and buffer:
            raise CheckpointError(
                f"{self.name}: state['structure'] is None but the buffer holds elements"
            )
        self._held.load(self.name, self.BUFFER, buffer, structure)
        self._source.load_state_dict(state[self.INPUT])
        self._buffer, self._skip, self._input_done = list(buffer), skip, input_done

    def shutdown(self) -> None:
        self._buffer = []

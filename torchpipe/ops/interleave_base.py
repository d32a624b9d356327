"""The interleave state machine that every interleave iterator shares, and the read-ahead base
of the parallel ones (threads in ``thread_interleave.py``, processes in ``process_interleave.py``).

tf.data's sequential interleave algorithm: ``cycle_length`` slots, a cycle index and a block
index. The current slot yields up to ``block_length`` elements before the cycle moves on; an
exhausted slot is cleared and the cycle moves on; an empty slot is refilled from the next input
element without moving. The checkpoint (the same for every iterator) is the input's position,
the next input sequence number, the cycle and block indices, the end-of-input flag, and for each
open slot the input element that made it, its sequence number and the inner iterator's state.
"""

from __future__ import annotations

import abc
import dataclasses
from collections import deque
from typing import Any

from torchpipe.errors import CheckpointError
from torchpipe.ops.base import BuildContext, Iterator, PositionLog, UserFunction, check_state
from torchpipe.ops.stats import LiveKnob
from torchpipe.runtime.timing import CallTiming

MAX_PARALLELISM = 64
"""The most readers the autotuner runs at once for a parallel interleave."""

_READER_BYTES = 4 << 20  # what one reader may hold read ahead (AUTOTUNE),
_MAX_READ_AHEAD = 4096  # and at most this many elements,
_DEEP_READ_AHEAD = 4  # once there are this many reads in flight a slot


def read_ahead_items(bytes_per_element: float) -> int:
    """Elements one reader may hold read ahead with AUTOTUNE: 4 MB of them, at most 4096."""
    return min(_READER_BYTES // max(int(bytes_per_element), 1), _MAX_READ_AHEAD)


# What taking from a slot can give: an element, an element's error (the slot stays open),
# the end of the inner dataset, or a failure to open it (the user function or the input raised).
_VALUE, _ERROR, _END, _FAILED = "value", "error", "end", "failed"


class InnerOpener:
    """Builds the iterator of the dataset that the user function makes from one input element.

    Holds no reference to the interleave iterator, so pool threads can call it freely.

    Args:
        fn: the user function, wrapped for this stage.
        ctx: the interleave's build context; inner dataset ``seq`` is built in ``ctx.inner(seq)``.
    """

    __slots__ = ("_fn", "_ctx")

    def __init__(self, fn: UserFunction, ctx: BuildContext) -> None:
        self._fn = fn
        self._ctx = ctx

    def seed_worker(self, slot: int) -> None:
        """See :meth:`UserFunction.seed_worker`."""
        self._fn.seed_worker(slot)

    def __call__(self, element: Any, seq: int, state: dict[str, Any] | None) -> Iterator:
        """The inner iterator of input element ``seq``, resumed at ``state`` if given.

        Raises:
            TypeError: if the function did not return a ``tp.Dataset``.
        """
        dataset = self._fn.on_element(seq, element)
        if not hasattr(dataset, "_node"):
            raise TypeError(
                f"{self._fn.stage}: the function must return a tp.Dataset, got {type(dataset).__name__} "
                f"(input element {seq})"
            )
        iterator = dataset._node.build(self._ctx.inner(seq))
        if state is not None:
            iterator.load_state_dict(state)
        return iterator


class InterleaveBase(Iterator):
    """tf.data's sequential interleave state machine over abstract slots.

    Subclasses say how a slot is filled from the input (:meth:`_fill_slot`), how the next item
    is taken from a slot (:meth:`_take`), and how slots are saved, restored and closed.
    """

    INPUT, SEQ, SLOTS = "input", "seq", "slots"
    CYCLE_INDEX, BLOCK_INDEX, END_OF_INPUT = "cycle_index", "block_index", "end_of_input"
    ELEMENT, INNER = "element", "inner"

    def __init__(self, name: str, source: Iterator, opener: InnerOpener, cycle_length: int, block_length: int) -> None:
        super().__init__(name, source)
        self._source = source
        self._opener = opener
        self._cycle_length = cycle_length
        self._block_length = block_length
        self._slots: list[Any] = [None] * cycle_length
        self._cycle_index = 0
        self._block_index = 0
        self._end_of_input = False
        self._num_open = 0

    def next(self) -> Any:
        while not self._end_of_input or self._num_open > 0:
            self._choose_slot()
            slot = self._slots[self._cycle_index]
            if slot is None:
                if self._end_of_input:
                    self._advance_cycle()
                else:
                    self._fill_slot()
                continue
            kind, payload = self._take(slot)
            if kind == _VALUE:
                self._block_index += 1
                if self._block_index == self._block_length:
                    self._advance_cycle()
                return payload
            if kind == _ERROR:
                raise payload
            self._clear_slot()
            if kind == _FAILED:
                # Like tf.data: the slot stays current, so the next call refills it.
                raise payload
            self._advance_cycle()
        raise StopIteration

    def _advance_cycle(self) -> None:
        self._block_index = 0
        self._cycle_index = (self._cycle_index + 1) % self._cycle_length

    def _put_slot(self, slot: Any) -> None:
        self._slots[self._cycle_index] = slot
        self._num_open += 1
        self.stats.counters["inner_datasets"] = self.stats.counters.get("inner_datasets", 0) + 1

    def _clear_slot(self) -> None:
        slot = self._slots[self._cycle_index]
        self._slots[self._cycle_index] = None
        self._num_open -= 1
        self._close_slot(slot)

    def _choose_slot(self) -> None:
        """Pick the slot to serve next; the deterministic order keeps the current one."""

    @abc.abstractmethod
    def _fill_slot(self) -> None:
        """Put the next input element's inner dataset in the current slot, or mark the end."""

    @abc.abstractmethod
    def _take(self, slot: Any) -> tuple[str, Any]:
        """The next ``(kind, payload)`` of ``slot``."""

    @abc.abstractmethod
    def _close_slot(self, slot: Any) -> None:
        """Release ``slot``'s inner iterator."""

    @abc.abstractmethod
    def _input_state(self) -> tuple[dict[str, Any], int]:
        """The input's state as of the last element given to a slot, and the next seq."""

    @abc.abstractmethod
    def _load_input_state(self, state: dict[str, Any], seq: int) -> None:
        """Resume the input at ``state``, numbering its next element ``seq``."""

    @abc.abstractmethod
    def _slot_state(self, slot: Any) -> dict[str, Any]:
        """``{element, seq, inner}`` of an open slot."""

    @abc.abstractmethod
    def _restore_slot(self, element: Any, seq: int, inner: dict[str, Any] | None) -> Any:
        """A slot that resumes inner dataset ``seq`` (made from ``element``) at ``inner``."""

    def get_state(self) -> dict[str, Any]:
        input_state, seq = self._input_state()
        return {
            self.INPUT: input_state,
            self.SEQ: seq,
            self.CYCLE_INDEX: self._cycle_index,
            self.BLOCK_INDEX: self._block_index,
            self.END_OF_INPUT: self._end_of_input,
            self.SLOTS: [None if slot is None else self._slot_state(slot) for slot in self._slots],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        keys = (self.INPUT, self.SEQ, self.CYCLE_INDEX, self.BLOCK_INDEX, self.END_OF_INPUT, self.SLOTS)
        check_state(self.name, state, *keys)
        saved = state[self.SLOTS]
        if len(saved) != self._cycle_length:
            raise CheckpointError(
                f"{self.name}: checkpoint has {len(saved)} slots but cycle_length is {self._cycle_length}"
            )
        self._load_input_state(state[self.INPUT], int(state[self.SEQ]))
        self._cycle_index = int(state[self.CYCLE_INDEX])
        self._block_index = int(state[self.BLOCK_INDEX])
        self._end_of_input = bool(state[self.END_OF_INPUT])
        # Slots restored before the first element hold no resources yet: nothing to close.
        self._slots = [
            None if entry is None else self._restore_slot(entry[self.ELEMENT], int(entry[self.SEQ]), entry[self.INNER])
            for entry in saved
        ]
        self._num_open = sum(slot is not None for slot in self._slots)

    def shutdown(self) -> None:
        for i, slot in enumerate(self._slots):
            if slot is not None:
                self._close_slot(slot)
            self._slots[i] = None


class ReadAheadInterleave(InterleaveBase):
    """Base of the parallel iterators: input elements are pulled ahead, in order, into readers
    that start reading their inner datasets at once, and handed to slots first in first out.

    Since the input is consumed strictly in order, the deterministic output order is exactly
    the inline one. The checkpoint's input position is that of the last element given to a
    slot: readers not yet in a slot are pulled again after a resume.

    Readers run on a pool of ``parallelism`` threads or processes, and as many readers as that
    are kept open (in slots and ahead of them) so every one of them has something to read. With
    ``tunable`` (``num_parallel_calls=AUTOTUNE``) the autotuner resizes the pool while it runs:
    the order and the checkpoint do not depend on it.

    Args:
        parallelism: threads or worker processes reading.
        tunable: let the autotuner change ``parallelism``.
    """

    tuning_role = "pool"

    def __init__(
        self, name: str, source: Iterator, opener: InnerOpener, cycle_length: int, block_length: int,
        parallelism: int, tunable: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(name, source, opener, cycle_length, block_length)
        self.stats.calls = CallTiming()
        self._log = PositionLog(source)
        self._parallelism = parallelism
        self._lookahead = self._lookahead_for(parallelism)
        self._futures: deque[Any] = deque()
        self._input_done = False
        self._pool: Any = None
        self._knob: LiveKnob | None = None
        if tunable:
            self._knob = LiveKnob(f"{name}.parallelism", parallelism, 1, MAX_PARALLELISM, False, self.resize)

    def _lookahead_for(self, parallelism: int) -> int:
        """Readers opened ahead of the slots: enough that ``parallelism`` readers are open."""
        return max(min(self._cycle_length, parallelism), parallelism - self._cycle_length)

    def knobs(self) -> list[LiveKnob]:
        return [self._knob] if self._knob is not None else []

    def parallelism(self) -> int:
        return self._parallelism

    def calls_in_processes(self) -> bool:
        return False  # the process iterator's say otherwise

    def resize(self, parallelism: int) -> None:
        """Keep ``parallelism`` readers open and reading from now on (the knob's setter)."""
        self._parallelism = parallelism
        self._lookahead = self._lookahead_for(parallelism)
        self._set_read_ahead(self._deep_read_ahead())
        if self._pool is not None:
            self._resize_pool(parallelism)

    def _resize_pool(self, parallelism: int) -> None:
        self._pool.resize(parallelism)

    def next(self) -> Any:
        if self._knob is not None:
            self._knob.take_request()
        self._top_up()
        element = super().next()
        if self.stats.sample_bytes(element):
            self._set_read_ahead(self._deep_read_ahead())
        return element

    def _deep_read_ahead(self) -> int:
        """Items each reader may read ahead beyond its usual few, or 0.

        With AUTOTUNE and ``_DEEP_READ_AHEAD`` times as many reads in flight as the cycle has
        slots, most reads are for readers waiting for a slot (slow storage behind a short cycle),
        so those read far ahead: :func:`read_ahead_items`, by the elements' size. Otherwise
        reading far ahead only takes the CPU from the readers in the slots, which the output
        waits for: throughput then comes in bursts, and starts slowly (docs/autotune.md).
        """
        deep = self._parallelism >= _DEEP_READ_AHEAD * self._cycle_length
        if self._knob is None or not deep or not self.stats.bytes_n:  # sized from the first element on
            return 0
        return read_ahead_items(self.stats.bytes_per_element)

    @abc.abstractmethod
    def _set_read_ahead(self, items: int) -> None:
        """Let each reader hold ``items`` read ahead (0: its usual few)."""

    def _servable_slot(self) -> int | None:
        """The first slot, from the current one on, that can be served without waiting (the
        non-deterministic order serves it instead of waiting for the current one)."""
        for step in range(self._cycle_length):
            index = (self._cycle_index + step) % self._cycle_length
            reader = self._slots[index]
            if reader is None:
                # An empty slot is served at once: refilled, or skipped at the end of input.
                if step == 0 or not self._end_of_input:
                    return index
            elif self._has_ready(reader):
                return index
        return None

    def _serve(self, index: int) -> None:
        """Make slot ``index`` the current one (the non-deterministic order)."""
        if index != self._cycle_index:
            self._cycle_index = index
            self._block_index = 0

    @abc.abstractmethod
    def _has_ready(self, reader: Any) -> bool:
        """Whether ``reader`` has an item to take without waiting."""

    @abc.abstractmethod
    def _new_reader(self, element: Any, seq: int, state: dict[str, Any] | None, error: BaseException | None) -> Any:
        """A reader for inner dataset ``seq`` (resumed at ``state``), or one that only raises ``error``."""

    @abc.abstractmethod
    def _start_reading(self, reader: Any) -> None:
        """Have ``reader`` read ahead (it asks again by itself as it is taken from)."""

    def _top_up(self) -> None:
        """Pull ahead: open readers for input elements up to the lookahead and start them."""
        for reader in self._pull_ahead():
            self._start_reading(reader)

    def _pull_ahead(self) -> list[Any]:
        """Open readers for input elements up to the lookahead; returns the new ones."""
        added = []
        while not self._input_done and len(self._futures) < self._lookahead:
            try:
                seq, element, error = self._log.pull()
            except StopIteration:
                self._input_done = True
                break
            added.append(self._new_reader(element, seq, None, error))
            self._futures.append(added[-1])
        return added

    def _fill_slot(self) -> None:
        self._top_up()
        if not self._futures:
            self._end_of_input = True
            return
        reader = self._futures.popleft()
        self._log.delivered(reader.seq)
        self._put_slot(reader)

    def _input_state(self) -> tuple[dict[str, Any], int]:
        state = self._log.state()
        return state["input"], state["seq"]

    def _load_input_state(self, state: dict[str, Any], seq: int) -> None:
        self._log.set_state({"input": state, "seq": seq, "skip": []})

    def _restore_slot(self, element: Any, seq: int, inner: dict[str, Any] | None) -> Any:
        return self._new_reader(element, seq, inner, None)

    # -- handing a running pass to another parallel interleave ------------------------------
    def hand_over(self, read_ahead: bool = False) -> Handover:
        """Everything another parallel interleave needs to go on from here, mid-pass.

        The caller then shuts this one down (not its input, which the successor reads on).
        The successor's readers resume at the inner states after the items taken, so nothing is
        lost or repeated; with ``read_ahead`` (readers stopped, successor in this process) they
        also get the items read but not yet taken, so nothing is read twice either.
        """
        def entry(reader: Any) -> _ReaderEntry:
            ahead = tuple(self._read_ahead_of(reader)) if read_ahead else ()
            return _ReaderEntry(reader.element, reader.seq, self._slot_state(reader)[self.INNER], reader.error, ahead)

        return Handover(
            log=self._log,
            cycle_index=self._cycle_index,
            block_index=self._block_index,
            end_of_input=self._end_of_input,
            input_done=self._input_done,
            slots=[None if reader is None else entry(reader) for reader in self._slots],
            ahead=[entry(reader) for reader in self._futures],
            knob=self._knob,
        )

    def take_over(self, handover: Handover) -> None:
        """Go on from ``handover`` (this iterator is started; it has served nothing yet)."""
        self._log = handover.log
        self._cycle_index, self._block_index = handover.cycle_index, handover.block_index
        self._end_of_input, self._input_done = handover.end_of_input, handover.input_done
        self._slots = [None if e is None else self._resumed_reader(e) for e in handover.slots]
        self._num_open = sum(r is not None for r in self._slots)
        self._futures = deque(self._resumed_reader(e) for e in handover.ahead)
        if handover.knob is not None:  # sized before the readers start, to any value requested meanwhile
            self._knob = handover.knob
            self._knob.rebind(self.resize)
            self._knob.take_request()
            if self._parallelism != self._knob.value:
                self.resize(self._knob.value)
        for r in [*self._slots, *self._futures]:
            if r is not None:
                self._start_reading(r)

    def _read_ahead_of(self, reader: Any) -> list[tuple[str, Any, Any]]:
        """Items ``reader`` read but the consumer has not taken, as ``(kind, payload, inner
        state after)``; only iterators that can hand them over say more than nothing."""
        return []

    def _resumed_reader(self, entry: _ReaderEntry) -> Any:
        """A reader that goes on where ``entry``'s left off. This one reads again what its
        predecessor read ahead (from the items taken); iterators that can take those items
        over give them to the reader instead."""
        return self._new_reader(entry.element, entry.seq, entry.inner, entry.error)


@dataclasses.dataclass(frozen=True)
class _ReaderEntry:
    element: Any
    seq: int
    inner: dict[str, Any] | None
    error: BaseException | None
    read_ahead: tuple[tuple[str, Any, Any], ...] = ()  # read, not taken: (kind, payload, inner state after)


@dataclasses.dataclass(frozen=True)
class Handover:
    """A running parallel interleave's place: the input log, the state machine, its readers
    (in slots and ahead of them) as ``(element, seq, inner state, input error, read ahead)``, and its
    parallelism knob (which the successor adopts, so the autotuner keeps turning it)."""

    log: PositionLog
    cycle_index: int
    block_index: int
    end_of_input: bool
    input_done: bool
    slots: list[_ReaderEntry | None]
    ahead: list[_ReaderEntry]
    knob: LiveKnob | None

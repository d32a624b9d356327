"""The interleave iterator (:class:`InterleaveIterator`): tf.data's cycle of slots over a pool of
readers, the bookkeeping of which reader is in which slot and which are open ahead of them, its
checkpoint, and the handover of the open readers when ``executor="auto"`` moves them (those the
consumer took from finish where they are).

The nodes that build it, and the pools they choose, are in ``interleave.py``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from torchpipe.core.iterator import Iterator
from torchpipe.core.position_log import PositionLog
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.core.tunable import POOL, Tunable
from torchpipe.errors import CheckpointError
from torchpipe.ops.interleave.placement import ReaderPlacement
from torchpipe.ops.interleave.readers import (
    ERROR,
    FAILED,
    MAX_PARALLELISM,
    VALUE,
    Reader,
    ReaderPool,
    read_ahead_items,
)
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.costs import INLINE, PROCESS
from torchpipe.runtime.timing import CallTiming

_DEEP_READ_AHEAD = 4  # reads in flight a slot from which AUTOTUNE readers read far ahead
DRAIN_S = 5.0
"""After a move, the most seconds the readers the consumer has taken from read on in the pool they
opened in: opened again in the other pool, an inner dataset that resumes by reading from its start
(``tp.from_iterable``) reads again all it gave (``latency``'s readers, moved from processes to
threads halfway through their shards, re-parsed ~50k records on the GIL: 1-7k records/s for 1.5-5 s,
against 30-40k). Those that have not ended by then move (one that never ends must not hold the
other pool up for good)."""


class _DirectInput:
    """The inline interleave's input. Every element it pulls goes to a slot at once, so the input's
    own state is the checkpoint's, asked for only when one is taken (a :class:`PositionLog` asks
    after every element, which behind a shuffle costs a copy of its buffer each time)."""

    def __init__(self, source: Iterator) -> None:
        self._source = source
        self._seq = 0

    def pull(self) -> tuple[int, Any, BaseException | None]:
        """``(seq, element, error)`` of the next input element; ``StopIteration`` at the end."""
        seq = self._seq
        try:
            element = next(self._source)
        except StopIteration:  # an Exception too, but the end, not an element's error
            raise
        except Exception as e:  # noqa: BLE001 - takes its place in the order, and uses up its number
            self._seq = seq + 1
            return seq, None, e
        self._seq = seq + 1
        return seq, element, None

    def delivered(self, seq: int) -> None:
        """Nothing to do: an element is delivered as it is pulled."""

    def state(self) -> dict[str, Any]:
        return {"input": self._source.state_dict(), "seq": self._seq}

    def set_state(self, state: dict[str, Any]) -> None:
        self._source.load_state_dict(state["input"])
        self._seq = int(state["seq"])


class InterleaveIterator(Iterator, Tunable):
    """tf.data's interleave over a pool of readers: inline, on threads or in worker processes.

    ``cycle_length`` slots, a cycle index and a block index: the current slot yields up to
    ``block_length`` elements before the cycle moves on; an exhausted slot is cleared and the cycle
    moves on; an empty slot is refilled from the next input element without moving. Input elements
    are pulled on the consumer's thread, in order, into readers handed to slots first in first
    out, so the deterministic order is tf.data's whatever the pool. A pool that reads ahead keeps
    ``parallelism`` readers open (in slots and ahead of them) so every read in flight has something
    to read; without determinism, a slot with nothing ready is passed over for the next that has.

    The checkpoint is the same for every pool: the input's position as of the last element given
    to a slot, the next input sequence number, the cycle and block indices, the end-of-input flag,
    and for each open slot the input element that made it, its sequence number and the inner
    iterator's state after the elements taken. What readers read ahead is not state: it is read
    again after a resume.

    Args:
        name: the stage name, e.g. ``interleave(read_file)``.
        source: the input iterator.
        pools: the reader pools by kind; the readers start in the first.
        cycle_length: number of inner datasets open at once.
        block_length: consecutive elements taken from one before moving to the next.
        parallelism: reads in flight (0 for the inline pool).
        deterministic: keep tf.data's order (the inline pool always does).
        tunable: ``num_parallel_calls=AUTOTUNE``: the autotuner changes ``parallelism`` while it runs.
        placement: moves the readers between ``pools`` (``executor="auto"``), or None.
    """

    tuning_role: str | None = POOL

    INPUT, SEQ, SLOTS = "input", "seq", "slots"
    CYCLE_INDEX, BLOCK_INDEX, END_OF_INPUT = "cycle_index", "block_index", "end_of_input"
    ELEMENT, INNER = "element", "inner"

    def __init__(
        self,
        name: str,
        source: Iterator,
        pools: dict[str, ReaderPool],
        cycle_length: int,
        block_length: int,
        *,
        parallelism: int = 0,
        deterministic: bool = True,
        tunable: bool = False,
        placement: ReaderPlacement | None = None,
    ) -> None:
        super().__init__(name, source)
        self._source = source
        self._pools = pools
        self._pool = next(iter(pools.values()))
        # after a move: the pool the readers that stayed read in, those readers, and until when
        self._old: ReaderPool | None = None
        self._staying: set[Reader] = set()
        self._drain_until = 0.0
        self._placement = placement
        self._cycle_length = cycle_length
        self._block_length = block_length
        self._empty_cycle()
        self._reads_ahead = self._pool.kind != INLINE
        self._log = PositionLog(source) if self._reads_ahead else _DirectInput(source)
        self._deterministic = deterministic or not self._reads_ahead
        self._parallelism = parallelism
        self._lookahead = self._lookahead_for(parallelism)
        self._knob: LiveKnob | None = None
        if tunable:
            self._knob = LiveKnob(
                f"{name}.parallelism", parallelism, 1, MAX_PARALLELISM, False, self.resize
            )
        self._bind_stats()

    def _empty_cycle(self) -> None:
        """The cycle before its first element: no reader in a slot or open ahead of them."""
        self._slots: list[Reader | None] = [None] * self._cycle_length
        self._cycle_index = self._block_index = self._num_open = 0
        self._end_of_input = self._input_done = False
        self._ahead: deque[Reader] = deque()  # readers opened for the slots to come, in input order

    def _bind_stats(self) -> None:
        """Count the reads where they run: on the pool's workers, timed as calls; inline, in
        ``next()``, as this iterator's self time (like any op on its caller's thread), which the
        autotuner does not tune as a pool."""
        if self._reads_ahead:
            self.stats.calls = CallTiming()
        else:
            self.tuning_role = None
        for pool in self._pools.values():
            pool.bind(self.stats)

    @property
    def executor_kind(self) -> str:
        """Where the readers read: ``inline``, ``thread`` or ``process``; ``auto`` until
        ``executor="auto"`` has made its first choice."""
        if self._placement is not None and self._placement.deciding:
            return "auto"
        return self._pool.kind

    def executor_report(self) -> dict[str, Any]:
        """Where the readers read, for ``it.stats()``: the ``executor`` kind, its ``workers``
        (threads or processes; with threads in each process, ``threads_per_worker``) and the
        worker processes' ``pids``."""
        return {"executor": self.executor_kind, **self._pool.report()}

    @property
    def open_readers(self) -> list[Reader]:
        """The open readers: those in the cycle's slots, then those opened ahead of them, in input
        order (a move hands them all over; tests look at them)."""
        return [*(reader for reader in self._slots if reader is not None), *self._ahead]

    @property
    def reader_pool(self) -> ReaderPool:
        """The pool the readers read in now (a move changes it): a seam for tests."""
        return self._pool

    @property
    def deterministic(self) -> bool:
        """Whether elements come in tf.data's order (False: as the readers' reads complete)."""
        return self._deterministic

    # -- the autotuner's view (core.tunable.Tunable) --------------------------------------
    def knobs(self) -> list[LiveKnob]:
        return [self._knob] if self._knob is not None else []

    def parallelism(self) -> int:
        return self._parallelism

    def buffer_slots(self) -> int:
        return (self._cycle_length + self._lookahead) * self._pool.reader_capacity()

    def calls_in_processes(self) -> bool:
        return self._pool.calls_in_processes

    def resize(self, parallelism: int) -> None:
        """Keep ``parallelism`` reads in flight from now on (the knob's setter)."""
        self._parallelism = parallelism
        self._lookahead = self._lookahead_for(parallelism)
        self._pool.set_read_ahead(self._deep_read_ahead())
        self._pool.resize(parallelism)

    def _lookahead_for(self, parallelism: int) -> int:
        """Readers opened ahead of the slots: enough that ``parallelism`` readers are open."""
        return max(min(self._cycle_length, parallelism), parallelism - self._cycle_length)

    def _deep_read_ahead(self) -> int:
        """Items each reader may read ahead beyond its usual few, or 0.

        With AUTOTUNE and ``_DEEP_READ_AHEAD`` times as many reads in flight as the cycle has
        slots, most reads are for readers waiting for a slot (slow storage behind a short cycle),
        so those read far ahead: :func:`read_ahead_items`, by the elements' size. Otherwise
        reading far ahead only takes the CPU from the readers in the slots, which the output
        waits for: throughput then comes in bursts, and starts slowly (docs/autotune.md).
        """
        deep = self._parallelism >= _DEEP_READ_AHEAD * self._cycle_length
        # sized from the first element on
        if self._knob is None or not deep or not self.stats.bytes_n:
            return 0
        return read_ahead_items(self.stats.bytes_per_element)

    # -- running ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        super().prepare()
        for pool in self._pools.values():
            pool.prepare()

    def start(self) -> None:
        self._pool.start(self._parallelism)
        for reader in self._slots:  # restored from a checkpoint
            if reader is not None:
                self._pool.read(reader)

    def _pool_of(self, reader: Reader) -> ReaderPool:
        """The pool ``reader`` reads in: the one it opened in while it stays there after a move."""
        return self._old if self._old is not None and reader in self._staying else self._pool

    def next(self) -> Any:
        # tf.data's state machine: the next element, from the slot whose turn it is. A pool that
        # reads ahead also takes the knob's requests, opens readers ahead of the slots and looks
        # at what it delivers; inline reads need none of it.
        if self._reads_ahead:
            self._before()
        return self._step()

    def take(self, count: int) -> list[Any]:
        """Up to ``count`` elements, as ``count`` calls of ``next()`` give them (a fused batch's
        chunk), at the cost of one: the knob's request and the readers opened ahead are looked
        at once, and the chunk is clocked as a whole (``IteratorStats.clocked_together``)."""
        if not self.running:  # the first element starts the pool (or a closed iterator says so)
            return super().take(count)
        stats = self.stats
        t0, waited = time.perf_counter(), stats.wait_s
        if self._reads_ahead:
            self._before()
        elements: list[Any] = []
        try:
            while len(elements) < count:
                elements.append(self._step())
                stats.produced += 1
        except StopIteration:
            if not elements:
                raise
        finally:
            stats.clocked_together(t0, time.perf_counter(), stats.wait_s - waited)
        return elements

    def _step(self) -> Any:
        while not self._end_of_input or self._num_open > 0:
            self._choose_slot()
            reader = self._slots[self._cycle_index]
            if reader is None:
                if self._end_of_input:
                    self._advance_cycle()
                else:
                    self._fill_slot()
                continue
            pool = self._pool if self._old is None else self._pool_of(reader)
            kind, payload = pool.take(reader)
            if kind == VALUE:
                self._block_index += 1
                if self._block_index == self._block_length:
                    self._advance_cycle()
                if self._reads_ahead:
                    self._after(payload)
                return payload
            if kind == ERROR:
                raise payload
            self._clear_slot()
            if kind == FAILED:
                # Like tf.data: the slot stays current, so the next call refills it.
                raise payload
            self._advance_cycle()
        self._end_of_pass()
        raise StopIteration

    def _before(self) -> None:
        if self._knob is not None:
            self._knob.take_request()
        self._top_up()

    def _after(self, element: Any) -> None:
        """Learn from a delivered element: its size (how far to read ahead), and every few
        elements, where the readers should read (``executor="auto"``)."""
        if self.stats.sample_bytes(element):
            self._pool.set_read_ahead(self._deep_read_ahead())
        placement = self._placement
        if (
            placement is not None and (self.stats.produced + 1) % placement.check_every == 0
        ):  # this one not counted yet
            self._review(element)

    def _advance_cycle(self) -> None:
        self._block_index = 0
        self._cycle_index = (self._cycle_index + 1) % self._cycle_length

    def _fill_slot(self) -> None:
        """Give the current slot the next reader in input order, or mark the end of the input."""
        if len(self._ahead) < self._lookahead:
            self._top_up()
        reader = self._ahead.popleft() if self._ahead else self._open_next()  # inline: none ahead
        if reader is None:
            self._end_of_input = True
            return
        self._log.delivered(reader.seq)
        self._slots[self._cycle_index] = reader
        self._num_open += 1
        self.stats.counters["inner_datasets"] = self.stats.counters.get("inner_datasets", 0) + 1

    def _clear_slot(self) -> None:
        reader = self._slots[self._cycle_index]
        assert reader is not None  # the slot cleared holds the reader that ended
        self._slots[self._cycle_index] = None
        self._num_open -= 1
        self._pool_of(reader).close(reader)
        if self._old is not None:
            self._staying.discard(reader)
            if not self._staying:
                self._drained()

    def _top_up(self) -> None:
        """Open readers ahead of the slots, up to the lookahead."""
        while len(self._ahead) < self._lookahead:
            reader = self._open_next()
            if reader is None:
                return
            self._ahead.append(reader)

    def _open_next(self) -> Reader | None:
        """A reader, reading, for the next input element; None at the input's end."""
        if self._input_done:
            return None
        try:
            seq, element, error = self._log.pull()
        except StopIteration:
            self._input_done = True
            return None
        reader = self._pool.open(element, seq, None, error)
        self._pool.read(reader)
        return reader

    def _choose_slot(self) -> None:
        """Without determinism, serve the first slot from the current one on that has something."""
        if self._deterministic:
            return
        index = self._servable_slot()
        if index is None:
            t0 = time.perf_counter()
            current = self._slots[self._cycle_index]
            pool = self._pool if current is None else self._pool_of(current)
            while index is None:
                pool.wait(lambda: self._servable_slot() is not None)
                index = self._servable_slot()
            self.stats.wait_s += time.perf_counter() - t0
        if index != self._cycle_index:
            self._cycle_index = index
            self._block_index = 0

    def _servable_slot(self) -> int | None:
        """The first slot, from the current one on, that can be served without waiting."""
        for step in range(self._cycle_length):
            index = (self._cycle_index + step) % self._cycle_length
            reader = self._slots[index]
            if reader is None:
                # An empty slot is served at once: refilled, or skipped at the end of input.
                if step == 0 or not self._end_of_input:
                    return index
            elif self._pool_of(reader).has_ready(reader):
                return index
        return None

    # -- executor="auto": moving the readers -----------------------------------------------------
    def _review(self, element: Any) -> None:
        """Let the placement look at the counters; move the readers if it says so."""
        placement = self._placement
        assert placement is not None  # reviewed under executor="auto"
        if self._old is not None:  # judged once every reader reads in the pool they moved to
            if time.perf_counter() >= self._drain_until:
                self._move_staying()
            return
        kind = placement.review(self.stats)
        if kind is not None:
            self._move(kind, element)
        # threads for good: the worker processes' zygote holds memory for nothing
        if placement.settled:
            self._pools.pop(PROCESS).shutdown()
            self._placement = None

    def _move(self, kind: str, element: Any) -> None:
        """Move the readers to pool ``kind``: readers open from now on open there, and so do the
        open ones the consumer has taken nothing from, with what they read ahead. Those it has
        taken from stay, reading on where they are until they end (for at most
        :data:`DRAIN_S`): opened there again, an inner dataset that resumes by reading from its
        start would read again all it gave. The input position, the cycle and each reader's
        place stay as they are, so nothing is lost, repeated, reordered or read twice. Readers
        whose input elements, positions or elements (``element`` stands for them) cannot go there
        stay, for good."""
        assert self._placement is not None  # moved under executor="auto"
        old, new = self._pool, self._pools[kind]
        readers = self.open_readers
        places = [old.place(reader) for reader in readers]
        if not new.accepts(places, element):
            self._placement.settle()
            return
        # those the consumer took from (an inner state) stay; the others open there at no cost
        staying = {r for r, place in zip(readers, places) if place.inner is not None}
        self._pool = new
        parallelism = self._parallelism
        if self._knob is not None:  # the autotuner goes on from the policy's count
            parallelism = min(self._placement.workers(), MAX_PARALLELISM)
            self._knob.moved(parallelism)
        # sized before the readers ask: their first reads use every worker thread
        new.start(parallelism)
        self.resize(parallelism)
        self._hand_over(old, [r for r in readers if r not in staying], others_stay=bool(staying))
        if staying:
            self._old, self._staying = old, staying
            self._drain_until = time.perf_counter() + DRAIN_S
        else:
            old.park()
        self._placement.moved(kind, self.stats.produced + self._cycle_length * self._block_length)

    def _hand_over(self, old: ReaderPool, readers: list[Reader], others_stay: bool) -> None:
        """Let ``readers`` go from ``old`` and open them again, reading, in the current pool."""
        if not readers:
            return
        new = self._pool
        opened = {
            r: new.open(*place) for r, place in zip(readers, old.release(readers, others_stay))
        }
        self._slots = [None if r is None else opened.get(r, r) for r in self._slots]
        self._ahead = deque(opened.get(r, r) for r in self._ahead)
        for reader in opened.values():
            new.read(reader)

    def _move_staying(self) -> None:
        """:data:`DRAIN_S` after a move: the readers still reading where they were go over too."""
        assert self._old is not None  # draining
        staying = [r for r in self.open_readers if r in self._staying]
        self._hand_over(self._old, staying, others_stay=False)
        self._drained()

    def _drained(self) -> None:
        """Every reader reads in the pool they moved to: the other one stops, and the windows
        that judge the new pool start now (what the readers did meanwhile was both pools')."""
        assert self._old is not None and self._placement is not None  # draining, under "auto"
        self._old.park()
        self._old, self._staying = None, set()
        kind = self._pool.kind
        self._placement.moved(kind, self.stats.produced + self._cycle_length * self._block_length)

    def _end_of_pass(self) -> None:
        """Free threads and workers now rather than at close()."""
        self._pool.park()
        for kind in [kind for kind, pool in self._pools.items() if pool is not self._pool]:
            self._pools.pop(kind).shutdown()
        self._placement = None

    # -- checkpoints -----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        state = self._log.state()
        return {
            self.INPUT: state["input"],
            self.SEQ: state["seq"],
            self.CYCLE_INDEX: self._cycle_index,
            self.BLOCK_INDEX: self._block_index,
            self.END_OF_INPUT: self._end_of_input,
            self.SLOTS: [None if r is None else self._slot_state(r) for r in self._slots],
        }

    def _slot_state(self, reader: Reader) -> dict[str, Any]:
        return {
            self.ELEMENT: reader.element,
            self.SEQ: reader.seq,
            self.INNER: self._pool_of(reader).inner_state(reader),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        keys = (
            self.INPUT,
            self.SEQ,
            self.CYCLE_INDEX,
            self.BLOCK_INDEX,
            self.END_OF_INPUT,
            self.SLOTS,
        )
        check_state(self.name, state, *keys)
        saved = state[self.SLOTS]
        if len(saved) != self._cycle_length:
            raise CheckpointError(
                f"{self.name}: checkpoint has {len(saved)} slots but cycle_length is {self._cycle_length}"
            )
        name = self.name
        self._log.set_state(
            {"input": state[self.INPUT], "seq": check_int(name, state, self.SEQ, 0), "skip": []}
        )
        self._cycle_index = check_int(name, state, self.CYCLE_INDEX, 0, self._cycle_length - 1)
        self._block_index = check_int(name, state, self.BLOCK_INDEX, 0, self._block_length - 1)
        self._end_of_input = check_bool(name, state, self.END_OF_INPUT)
        # Readers restored before the first element hold no resources yet: nothing to close.
        self._slots = [
            None
            if e is None
            else self._pool.open(e[self.ELEMENT], check_int(name, e, self.SEQ, 0), e[self.INNER])
            for e in saved
        ]
        self._num_open = sum(reader is not None for reader in self._slots)

    # -- closing ---------------------------------------------------------------------------------
    def children(self) -> list[Iterator]:
        slotted = [r for r in self._slots if r is not None]
        children = self._pool.children([r for r in slotted if r not in self._staying])
        if self._old is not None:
            children += self._old.children([r for r in slotted if r in self._staying])
        return [self._source, *children]

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        for reader in [*self._slots, *self._ahead]:
            if reader is not None:
                self._pool_of(reader).close(reader)
        self._slots = [None] * self._cycle_length
        self._ahead.clear()
        self._old, self._staying = None, set()

"""``interleave(..., executor="process")``: inner datasets read in worker processes.

The interleave order is still decided in the main process by the same state machine as the
inline iterator (:class:`~torchpipe.ops.interleave_base.InterleaveBase`), so the deterministic order
is exactly tf.data's. What moves to the workers is the reading: a task asks a worker to open one
inner dataset at a saved position, read the next chunk of elements, and send them back together
with the inner iterator's state after each one. A worker keeps the inner datasets it has open
between chunks (each reader's chunks go to the same worker), so a stream is read once, not
re-opened per chunk; a chunk that lands elsewhere (after a resize or a worker's death) opens the
inner dataset at its saved position instead, so central dispatch, resizing and restarts work as
for ``map``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from torchpipe.ops.base import Iterator
from torchpipe.ops.stats import element_bytes
from torchpipe.ops.interleave_base import (
    _END, _ERROR, _FAILED, _VALUE, InnerOpener, ReadAheadInterleave, _ReaderEntry,
)
from torchpipe.runtime.columns import Columns, to_columns
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.process_pool import ProcessPool

_WAIT_S = 0.5
_KEPT_OPEN = 64  # inner iterators a worker keeps open between chunks (least recently used go)
_CHUNK_ITEMS = 256  # a chunk ends at this many items,
_CHUNK_S = 0.02  # or once reading it took this long (slow reads: a few per round trip),
_CHUNK_BYTES = 4 << 20  # or at about this many bytes of tensors and arrays
_SIZE_EVERY = 8  # the chunk's size counts every item as the last one measured, measuring every 8th
_COLLECT_EVERY = 16  # items taken between looks for chunks that arrived for other readers
_READER_IDS = itertools.count()  # unique in the main process, whose forks the workers are


class InnerChunkTask:
    """Runs in a worker: read the next chunk of inner dataset ``seq``.

    A chunk ends at ``count`` items (at least ``block_length``), after ``_CHUNK_S`` seconds of
    reading or at ``_CHUNK_BYTES``, whichever comes first: one round trip carries many cheap items
    or several slow reads, and little memory.

    The payload names the reader (``reader_id``) and how many items it has read so far; a
    worker that still has that reader's inner iterator open at that position reads on from it,
    any other opens the inner dataset at ``state``. Returns a list of ``(kind, payload,
    inner_state_after)``; it ends with an ``_END`` item if the inner dataset ended. A chunk of
    values of one flat structure comes as a :class:`PackedChunk` (its values as columns) instead.
    Worker processes inherit the task through fork. Threads of a worker may run tasks of
    different readers at once (a reader has one chunk in flight at a time).
    """

    def __init__(self, opener: InnerOpener) -> None:
        self.opener = opener
        self._open: OrderedDict[int, tuple[int, Iterator]] = OrderedDict()  # reader_id -> (position, iterator)
        self._lock = threading.Lock()

    def start_worker(self, slot: int) -> None:
        self.opener.seed_worker(slot)

    def __call__(self, task_id: int, payload: tuple) -> list[tuple[str, Any, Any]] | PackedChunk:
        element, seq, state, count, reader_id, position = payload
        with self._lock:
            kept = self._open.pop(reader_id, None)
        if kept is not None and kept[0] == position:
            iterator = kept[1]
        else:
            if kept is not None:
                kept[1].close()
            iterator = self.opener(element, seq, state)
        items: list[tuple[str, Any, Any]] = []
        deadline, nbytes, size = time.perf_counter() + _CHUNK_S, 0, 0
        try:
            while len(items) < count and (nbytes < _CHUNK_BYTES and time.perf_counter() < deadline or not items):
                try:
                    value = next(iterator)
                except StopIteration:
                    items.append((_END, None, None))
                    break
                except Exception as e:  # noqa: BLE001 - delivered in its place
                    items.append((_ERROR, e, iterator.state_dict()))
                    continue
                if len(items) % _SIZE_EVERY == 0:  # sizes of a stream's items change slowly
                    size = element_bytes(value)
                items.append((_VALUE, value, iterator.state_dict()))
                nbytes += size
        except BaseException:
            iterator.close()
            raise
        if items and items[-1][0] == _END:
            iterator.close()
        else:
            self._keep(reader_id, position + len(items), iterator)
        return _packed(items)

    def _keep(self, reader_id: int, position: int, iterator: Iterator) -> None:
        with self._lock:
            self._open[reader_id] = (position, iterator)
            evicted = [self._open.popitem(last=False)[1][1] for _ in range(len(self._open) - _KEPT_OPEN)]
        for oldest in evicted:
            oldest.close()


class PackedChunk:
    """A chunk of values only (perhaps then the end), with the values sent as columns."""

    __slots__ = ("values", "states", "ended")

    def __init__(self, values: Columns, states: list[Any], ended: bool) -> None:
        self.values, self.states, self.ended = values, states, ended

    def __len__(self) -> int:
        """Items in the chunk, as :meth:`items` lists them."""
        return len(self.states) + self.ended

    def items(self) -> list[tuple[str, Any, Any]]:
        """The chunk as :class:`InnerChunkTask` read it."""
        items = [(_VALUE, value, state) for value, state in zip(self.values.rows(), self.states)]
        return items + [(_END, None, None)] if self.ended else items


def _packed(items: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]] | PackedChunk:
    """``items`` as a :class:`PackedChunk` where its values go as columns, else as they are."""
    ended = bool(items) and items[-1][0] == _END
    values = items[:-1] if ended else items
    if any(kind != _VALUE for kind, _, _ in values):
        return items
    columns = to_columns([value for _, value, _ in values])
    return items if columns is None else PackedChunk(columns, [state for _, _, state in values], ended)


class _ChunkReader:
    """One open inner dataset, fed by chunk tasks; only the consumer's thread touches it."""

    __slots__ = ("id", "element", "seq", "initial_state", "error", "ready", "taken_state", "read_state", "read",
                 "last_chunk", "pending", "done")  # fmt: skip

    def __init__(self, element: Any, seq: int, state: dict[str, Any] | None, error: BaseException | None) -> None:
        self.id = next(_READER_IDS)
        self.element = element
        self.seq = seq
        self.initial_state = state
        self.error = error
        self.ready: deque[tuple[str, Any, Any]] = deque()
        self.taken_state = state  # inner state after the last item the consumer took
        self.read_state = state  # inner state after the last item read (where the next chunk starts)
        self.read = 0  # items read (where a worker that kept the inner iterator open stands)
        self.last_chunk = 0  # items in the last chunk received
        self.pending: int | None = None  # id of the chunk task in flight
        self.done = error is not None
        if error is not None:
            self.ready.append((_FAILED, error, None))

    def wants_chunk(self, ahead: int) -> bool:
        """Whether to ask for the next chunk: none is in flight and at most one chunk's worth
        (or ``ahead`` items) is ready, so a reader holds about two chunks (or ``ahead`` items)."""
        return self.pending is None and not self.done and len(self.ready) <= max(self.last_chunk, ahead)

    def receive(self, items: list[tuple[str, Any, Any]] | PackedChunk | None, error: BaseException | None) -> None:
        self.pending = None
        if error is not None:
            self.ready.append((_FAILED, error, None))
            self.done = True
            return
        if type(items) is PackedChunk:
            items = items.items()
        self.read += len(items)
        self.last_chunk = len(items)
        for kind, payload, state in items:
            self.ready.append((kind, payload, state))
            if kind == _END:
                self.done = True
            else:
                self.read_state = state


class ProcessInterleaveIterator(ReadAheadInterleave):
    """Interleaves inner datasets that worker processes read ahead, chunk by chunk.

    With ``threads_in_workers`` (the ``executor="auto"`` choice for readers that do real work),
    ``parallelism`` counts reads in flight rather than processes: one process per core (at most)
    runs them on threads of its own, so readers that wait on slow storage overlap their waits
    without a process (and its memory) each, while their Python work spreads over one GIL a core.

    Args:
        name: the stage name.
        source: the input iterator.
        opener: builds an inner iterator (used by the workers, inherited through fork).
        cycle_length: number of inner datasets open at once.
        block_length: consecutive elements taken from one before moving to the next.
        parallelism: number of worker processes (reads in flight with ``threads_in_workers``).
        restart: replace dead workers (else ``WorkerError``).
        tunable: let the autotuner change ``parallelism``.
        threads_in_workers: run several reads at once in each worker process.
        deterministic: keep the inline order; if False, a slot with nothing read yet is passed
            over for the next one that has something.
        stall_s: ``Options.stall_timeout``: a chunk out this long raises ``StallError``.
    """

    def __init__(
        self,
        name: str,
        source: Iterator,
        opener: InnerOpener,
        cycle_length: int,
        block_length: int,
        parallelism: int,
        restart: bool,
        tunable: bool = False,
        threads_in_workers: bool = False,
        deterministic: bool = True,
        stall_s: float | None = None,
    ) -> None:
        super().__init__(name, source, opener, cycle_length, block_length, parallelism, tunable)
        self._restart = restart
        self._threads_in_workers = threads_in_workers
        self._deterministic = deterministic
        self._chunk = max(_CHUNK_ITEMS, block_length)
        self._ahead = 0  # items a reader may hold beyond two chunks' worth (see _deep_read_ahead)
        self._waiting: dict[int, _ChunkReader] = {}  # chunk task -> the reader it is for
        self._dispatch: Dispatcher | None = None
        self._stall_s = stall_s
        self._next_task = 0
        self._taken = 0

    def prepare(self) -> None:
        super().prepare()
        if self._pool is None:
            processes, threads = self._workers(self._parallelism)
            self._pool = ProcessPool(InnerChunkTask(self._opener), processes, self.name, restart=self._restart,
                                     timing=self.stats.calls, threads=threads)  # fmt: skip
            self._dispatch = Dispatcher(self.name, self._pool, self._stall_s)

    def _workers(self, parallelism: int) -> tuple[int, int]:
        """Worker processes and threads in each for ``parallelism``."""
        if not self._threads_in_workers:
            return parallelism, 1
        processes = max(1, min(parallelism, usable_cpu_count()))
        return processes, -(-parallelism // processes)

    def _resize_pool(self, parallelism: int) -> None:
        processes, threads = self._workers(parallelism)
        self._pool.set_threads(threads)
        self._pool.resize(processes)

    def buffer_slots(self) -> int:
        return (self._cycle_length + self._lookahead) * max(2 * self._chunk, self._ahead)

    def calls_in_processes(self) -> bool:
        return True

    def start(self) -> None:
        self.prepare()
        self._pool.start()

    def _set_read_ahead(self, items: int) -> None:
        self._ahead = items

    def _new_reader(
        self, element: Any, seq: int, state: dict[str, Any] | None, error: BaseException | None
    ) -> _ChunkReader:
        return _ChunkReader(element, seq, state, error)

    def _resumed_reader(self, entry: _ReaderEntry) -> _ChunkReader:
        reader = super()._resumed_reader(entry)
        if entry.read_ahead:  # as if a chunk had brought them: the next chunk starts after them
            reader.receive(list(entry.read_ahead), None)
        return reader

    def _start_reading(self, reader: _ChunkReader) -> None:
        # A reader asks for its next chunk when it opens, when a chunk arrives and when an item
        # is taken from it: the only times wants_chunk() can change.
        if reader.wants_chunk(self._ahead):
            task = self._next_task
            self._next_task += 1
            reader.pending = task
            self._waiting[task] = reader
            payload = (reader.element, reader.seq, reader.read_state, self._chunk, reader.id, reader.read)
            self._dispatch.submit(task, payload, prefer=reader.id % self._pool.size)

    def _receive(self, timeout: float) -> None:
        """Hand the chunks that arrived (waiting up to ``timeout`` s for one) to their readers."""
        for task, items, error in self._dispatch.poll(timeout):
            if error is None:
                self.stats.calls.add_items(len(items))
            waiting = self._waiting.pop(task, None)
            if waiting is not None:
                waiting.receive(items, error)
                self._start_reading(waiting)

    def _choose_slot(self) -> None:
        if self._deterministic:
            return
        index = self._servable_slot()
        if index is None:
            t0 = time.perf_counter()
            for reader in self._slots:  # restored from a checkpoint, a slot has not asked yet
                if reader is not None:
                    self._start_reading(reader)
            while index is None:
                self._receive(_WAIT_S)
                index = self._servable_slot()
            self.stats.wait_s += time.perf_counter() - t0
        self._serve(index)

    def _has_ready(self, reader: _ChunkReader) -> bool:
        return bool(reader.ready)

    def _take(self, reader: _ChunkReader) -> tuple[str, Any]:
        while not reader.ready:
            self._start_reading(reader)
            t0 = time.perf_counter()
            self._receive(_WAIT_S)
            self.stats.wait_s += time.perf_counter() - t0
        kind, payload, state = reader.ready.popleft()
        if kind in (_VALUE, _ERROR):
            reader.taken_state = state
            self._start_reading(reader)
        self._taken += 1
        if self._taken % _COLLECT_EVERY == 0:  # readers not being taken from read on meanwhile
            self._receive(0.0)
        return kind, payload

    def _close_slot(self, reader: _ChunkReader) -> None:
        reader.done = True
        reader.ready.clear()
        if reader.pending is not None:
            self._waiting.pop(reader.pending, None)

    def _slot_state(self, reader: _ChunkReader) -> dict[str, Any]:
        return {self.ELEMENT: reader.element, self.SEQ: reader.seq, self.INNER: reader.taken_state}

    def shutdown(self) -> None:
        if self._dispatch is not None:
            self._dispatch.close()
        if self._pool is not None:
            self._pool.close()
        self._waiting.clear()
        self._futures.clear()
        super().shutdown()

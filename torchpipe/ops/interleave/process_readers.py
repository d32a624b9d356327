"""Interleave readers in worker processes: each open inner dataset is read ahead chunk by chunk.

A chunk task asks a worker to read the next chunk of an inner dataset's elements and send them
back together with the inner iterator's state after them. A worker keeps the inner datasets it has
open between chunks (each reader's chunks go to the same worker), so a stream is read once, not
re-opened per chunk. A reader the consumer takes from keeps two chunks out (``IN_FLIGHT``; one
while it waits ahead of the slots): the worker reads the next while one travels. Chunks are
numbered per reader. The first chunk out carries the state to open at, where a worker that does
not hold the inner iterator there opens it; the second only says "go on after chunk k" (its state
is not known yet), and a worker that does not hold the iterator after chunk k (after a resize or
a worker's death) answers :class:`StaleChunk`, and the reader asks for it again with the state
once chunk k is in. The reader takes chunks in their order, whatever order they arrive in, so
central dispatch, resizing and restarts work as for ``map``. Chunks go through the runtime's
:class:`~torchpipe.runtime.dispatch.Dispatcher` (as completed), so their waits are bounded and
watched like every other stage's.
"""

from __future__ import annotations

import itertools
import pickle
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torchpipe.ops.interleave.chunk_task import InnerChunkTask, PackedChunk, StaleChunk
from torchpipe.ops.interleave.readers import (
    END,
    ERROR,
    FAILED,
    VALUE,
    InnerOpener,
    Item,
    Reader,
    ReaderPlace,
    ReaderPool,
    items_after,
)
from torchpipe.runtime import codec
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.placement.costs import PROCESS
from torchpipe.runtime.processes.pool import ProcessPool

_WAIT_S = 0.5
_STOP_S = 0.1  # how long release() waits for chunks in flight
CHUNK_ITEMS = 256  # a chunk ends at this many items (or chunk_task's CHUNK_S, CHUNK_BYTES)
_COLLECT_EVERY = 16  # items taken between looks for chunks that arrived for other readers
_READER_IDS = itertools.count()  # unique in the main process, whose forks the workers are
IN_FLIGHT = 2  # chunks a reader keeps out: a worker reads the next while one travels


class _ChunkReader(Reader):
    """One open inner dataset, fed by chunk tasks; only the consumer's thread touches it.

    Its chunks are numbered from 0; up to ``IN_FLIGHT`` are out at once, and they are handed in
    (to ``ready``) in their order, whatever order they come back in."""

    __slots__ = (
        "id",
        "ready",
        "taken_state",
        "taken_after",
        "read_state",
        "last_chunk",
        "asked",
        "handed",
        "out",
        "early",
        "stale",
        "taken",
        "done",
    )

    def __init__(
        self,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None,
        error: BaseException | None,
        read_ahead: tuple[Item, ...],
    ) -> None:
        super().__init__(element, seq, error)
        self.id = next(_READER_IDS)
        self.ready: deque[Item] = deque()
        # the consumer's position: ``taken_after`` items after the inner state ``taken_state``
        # (an item within a chunk carries no state of its own; its position is made when asked)
        self.taken_state = inner
        self.taken_after = 0
        # inner state after the last item handed in (where the next chunk starts)
        self.read_state = inner
        self.last_chunk = 0  # items in the last chunk handed in
        self.asked = 0  # chunks asked for: the next one's number
        self.handed = 0  # chunks handed in: the number of the next one to hand in
        self.out: dict[int, int] = {}  # chunk task in flight -> its chunk's number
        # chunks that came before a chunk ahead of them, by number: (items, error)
        self.early: dict[int, tuple[list[Item] | PackedChunk | None, BaseException | None]] = {}
        self.stale: set[int] = set()  # answered stale: asked again once the chunk before is in
        self.taken = False  # taken from: in a slot of the cycle, not opened ahead of them
        self.done = error is not None
        if error is not None:
            self.ready.append((FAILED, error, None))
        elif read_ahead:  # as if a chunk had brought them: the next chunk starts after them
            self._hand_in(list(read_ahead), None)

    @property
    def pending(self) -> bool:
        """Whether a chunk task is out."""
        return bool(self.out)

    def wants_chunk(self, ahead: int) -> bool:
        """Whether to ask for the next chunk: fewer than ``IN_FLIGHT`` are out (none of them to
        be asked again; one until the consumer takes from the reader: readers opened ahead of
        the slots fill up without taking the workers from those it waits for) and at most one
        chunk's worth (or ``ahead`` items) is ready, so a reader holds about three chunks (or
        ``ahead`` items and two chunks) ready or in flight."""
        return (
            not self.done
            and not self.stale
            and self.asked - self.handed < (IN_FLIGHT if self.taken else 1)
            and len(self.ready) <= max(self.last_chunk, ahead)
        )

    def receive(
        self,
        task: int,
        items: list[Item] | PackedChunk | StaleChunk | None,
        error: BaseException | None,
    ) -> None:
        """Chunk task ``task`` came back: hand in its chunk, and those that came early after it,
        in their order; a stale one waits to be asked again."""
        chunk = self.out.pop(task)
        if isinstance(items, StaleChunk):
            self.stale.add(chunk)
            return
        self.early[chunk] = (items, error)
        while not self.done and self.handed in self.early:
            items, error = self.early.pop(self.handed)
            assert not isinstance(items, StaleChunk)  # kept apart above
            self.handed += 1
            self._hand_in(items, error)
        if self.done:  # what comes after the end or a failure is not wanted
            self.early.clear()
            self.stale.clear()

    def _hand_in(self, items: list[Item] | PackedChunk | None, error: BaseException | None) -> None:
        if error is not None:
            self.ready.append((FAILED, error, None))
            self.done = True
            return
        if isinstance(items, PackedChunk):
            items = items.items()
        assert items is not None  # no error: the chunk came
        self.last_chunk = len(items)
        self.ready.extend(items)
        values = len(items) - (bool(items) and items[-1][0] == END)
        if values < len(items):
            self.done = True
        if values:  # the chunk's last value carries the state after it (read_ahead: each does)
            state = items[values - 1][2]
            self.read_state = items_after(self.read_state, values) if state is None else state

    def take(self) -> Item:
        """The next ready item, the consumer's position moved past a value or an error."""
        self.taken = True
        item = self.ready.popleft()
        kind, _, state = item
        if kind in (VALUE, ERROR):
            if state is None:
                self.taken_after += 1
            else:
                self.taken_state, self.taken_after = state, 0
        return item

    def position(self) -> dict[str, Any] | None:
        """The inner position after the last item the consumer took."""
        if self.taken_after:
            return items_after(self.taken_state, self.taken_after)
        return self.taken_state

    def read_ahead(self) -> tuple[Item, ...]:
        """What was read and not taken; nothing while a chunk is out or if opening failed: the
        successor reads again from the items taken."""
        if self.pending or any(kind == FAILED for kind, _, _ in self.ready):
            return ()
        items, base, after = [], self.taken_state, self.taken_after
        for kind, payload, state in self.ready:  # each item with its position, as carried
            if kind == END:
                items.append((kind, payload, state))
                continue
            if state is None:
                after += 1
            else:
                base, after = state, 0
            items.append((kind, payload, items_after(base, after) if after else base))
        return tuple(items)


class ProcessReaders(ReaderPool[_ChunkReader]):
    """Reads the open inner datasets ahead in worker processes, chunk by chunk.

    With ``threads_in_workers`` (the ``executor="auto"`` choice), ``parallelism`` counts reads in
    flight rather than processes: one process per core (at most) runs them on threads of its own,
    so readers that wait on slow storage overlap their waits without a process (and its memory)
    each, while their Python work spreads over one GIL a core. Each read in flight has
    ``IN_FLIGHT`` threads: a reader's next chunk waits on one while the chunk before is read.

    Args:
        name: the stage name.
        opener: builds an inner iterator (used by the workers, inherited through fork).
        block_length: the interleave's; a chunk holds at least one block.
        restart: replace dead workers (else ``WorkerError``).
        stall_s: ``Options.stall_timeout``: a chunk out this long raises ``StallError``.
        threads_in_workers: run several reads at once in each worker process.
    """

    kind = PROCESS

    def __init__(
        self,
        name: str,
        opener: InnerOpener,
        block_length: int,
        restart: bool,
        stall_s: float | None,
        threads_in_workers: bool = False,
    ) -> None:
        self.name = name
        self._opener = opener
        self._restart = restart
        self._stall_s = stall_s
        self._threads_in_workers = threads_in_workers
        self._chunk = max(CHUNK_ITEMS, block_length)
        self._ahead = 0  # items a reader may hold beyond two chunks' worth
        self._waiting: dict[int, _ChunkReader] = {}  # chunk task -> the reader it is for
        self._pool: ProcessPool | None = None
        self._dispatch: Dispatcher | None = None
        self._reading = False  # chunks are asked for (not while parked or letting readers go)
        self._leaving: set[_ChunkReader] = set()  # readers let go while the others read on
        self._next_task = 0
        self._taken = 0

    @property
    def calls_in_processes(self) -> bool:
        return True

    def prepare(self) -> None:
        if self._pool is None:
            self._pool = self._make_pool(InnerChunkTask(self._opener))
            self._dispatch = Dispatcher(self.name, self._pool, self._stall_s)

    def _make_pool(self, task: InnerChunkTask) -> Any:
        """The pool the chunk tasks run on, empty until :meth:`start` sizes it."""
        return ProcessPool(task, 0, self.name, restart=self._restart, timing=self.stats.calls)

    def start(self, parallelism: int) -> None:
        self.prepare()
        self._reading = True
        self.resize(parallelism)

    def resize(self, parallelism: int) -> None:
        if self._reading:
            assert self._pool is not None  # reading: prepared
            processes, threads = self._workers(parallelism)
            self._pool.set_threads(threads)
            self._pool.resize(processes)

    def report(self) -> dict[str, Any]:
        if self._pool is None:
            return {}
        return {
            "workers": self._pool.size,
            "threads_per_worker": self._pool.threads,
            "pids": self._pool.pids,
        }

    def _workers(self, parallelism: int) -> tuple[int, int]:
        """Worker processes and threads in each for ``parallelism``."""
        if not self._threads_in_workers:
            return parallelism, 1
        processes = max(1, min(parallelism, usable_cpu_count()))
        return processes, IN_FLIGHT * -(-parallelism // processes)

    def set_read_ahead(self, items: int) -> None:
        self._ahead = items

    def reader_capacity(self) -> int:
        return max(self._chunk, self._ahead) + IN_FLIGHT * self._chunk

    def open(
        self,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None = None,
        error: BaseException | None = None,
        read_ahead: tuple[Item, ...] = (),
    ) -> _ChunkReader:
        return _ChunkReader(element, seq, inner, error, read_ahead)

    def read(self, reader: _ChunkReader) -> None:
        # A reader asks for chunks when it opens, when a chunk arrives and when an item is taken
        # from it: the only times what it wants can change.
        if not self._reading or reader.done or reader in self._leaving:
            return
        if reader.handed in reader.stale:  # the chunk before it is in: ask again, with its state
            reader.stale.discard(reader.handed)
            self._ask(reader, reader.handed)
        while reader.wants_chunk(self._ahead):
            reader.asked += 1
            self._ask(reader, reader.asked - 1)

    def _ask(self, reader: _ChunkReader, chunk: int) -> None:
        """Send the task for ``reader``'s chunk ``chunk``: one that follows a chunk not yet in
        goes on after it (its state is not known yet), any other starts at ``read_state``."""
        assert self._dispatch is not None and self._pool is not None  # reading: prepared
        task = self._next_task
        self._next_task += 1
        reader.out[task] = chunk
        self._waiting[task] = reader
        follows = chunk > reader.handed
        state = None if follows else reader.read_state
        payload = (reader.element, reader.seq, state, self._chunk, reader.id, chunk, follows)
        self._dispatch.submit(task, payload, prefer=reader.id % self._pool.size)

    def _receive(self, timeout: float) -> None:
        """Hand the chunks that arrived (waiting up to ``timeout`` s for one) to their readers."""
        # prepared; calls counted
        assert self._dispatch is not None and self.stats.calls is not None
        for task, items, error in self._dispatch.poll(timeout):
            if error is None and not isinstance(items, StaleChunk):
                self.stats.calls.add_items(len(items))
            waiting = self._waiting.pop(task, None)
            if waiting is not None:
                handed = waiting.handed
                waiting.receive(task, items, error)
                if waiting.done:  # chunks still out after the end come back to no one
                    self._forget(waiting)
                for later, chunk in waiting.out.items():
                    if handed < waiting.handed == chunk:  # it waited for the one before it
                        self._dispatch.began(later)
                self.read(waiting)

    def has_ready(self, reader: _ChunkReader) -> bool:
        return bool(reader.ready)

    def take(self, reader: _ChunkReader) -> tuple[str, Any]:
        while not reader.ready:
            self.read(reader)
            t0 = time.perf_counter()
            self._receive(_WAIT_S)
            self.stats.wait_s += time.perf_counter() - t0
        kind, payload, _ = reader.take()
        if kind in (VALUE, ERROR):
            self.read(reader)
        self._taken += 1
        if self._taken % _COLLECT_EVERY == 0:  # readers not being taken from read on meanwhile
            self._receive(0.0)
        return kind, payload

    def wait(self, until: Callable[[], bool]) -> None:
        if not until():
            self._receive(_WAIT_S)

    def inner_state(self, reader: _ChunkReader) -> dict[str, Any] | None:
        return reader.position()

    def close(self, reader: _ChunkReader) -> None:
        reader.done = True
        reader.ready.clear()
        self._forget(reader)

    def _forget(self, reader: _ChunkReader) -> None:
        """Let the chunks ``reader`` has out come back to no one."""
        for task in reader.out:
            self._waiting.pop(task, None)
        reader.out.clear()
        reader.early.clear()
        reader.stale.clear()

    def release(self, readers: list[_ChunkReader], others_stay: bool = False) -> list[ReaderPlace]:
        # chunks that arrive now are kept, and no more are asked for (by these readers alone
        # where the others stay and read on)
        if others_stay:
            self._leaving.update(readers)
        else:
            self._reading = False
        deadline = time.perf_counter() + _STOP_S
        while any(r.pending for r in readers) and time.perf_counter() < deadline:
            self._receive(max(0.0, deadline - time.perf_counter()))
        places = [
            ReaderPlace(r.element, r.seq, r.position(), r.error, r.read_ahead()) for r in readers
        ]
        for reader in readers:
            self.close(reader)
        self._leaving.difference_update(readers)
        return places

    def accepts(self, places: list[ReaderPlace], element: Any) -> bool:
        """Whether the readers' input elements and positions can be sent to a worker, and what
        they read can come back (``element``, one they gave, stands for it). Where not (an open
        file object, a lock), they cannot read here."""
        try:
            pickle.dumps(
                [(place.element, place.inner) for place in places], pickle.HIGHEST_PROTOCOL
            )
            codec.encode(element)  # tensors are not copied: only the rest is pickled
        except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
            return False
        return True

    def park(self) -> None:
        self._reading = False
        if self._pool is not None and self._dispatch is not None:  # made together
            self._dispatch.forget()  # chunks still out come back to no one
            self._waiting.clear()
            self._pool.resize(0)  # its zygote stays, ready to fork workers again

    def shutdown(self) -> None:
        self._reading = False
        if self._dispatch is not None:
            self._dispatch.close()
        if self._pool is not None:
            self._pool.close()
        self._waiting.clear()

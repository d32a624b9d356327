"""What a worker runs for an interleave's process readers: :class:`InnerChunkTask` reads the next
chunk of an inner dataset and sends it back, its values as columns where they are of one flat
structure (:class:`PackedChunk`), or :class:`StaleChunk` where it cannot go on where asked
(:mod:`torchpipe.ops.interleave.process_readers` is the main process's side)."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from torchpipe.core.iterator import Iterator
from torchpipe.ops.interleave.readers import END, ERROR, VALUE, InnerOpener, Item
from torchpipe.runtime.codec.columns import Columns, to_columns
from torchpipe.runtime.sizes import element_bytes
from torchpipe.runtime.timing import waited

_WAIT_S = 0.5  # how long a chunk waits at a time for the one before it
_KEPT_OPEN = 64  # inner iterators a worker keeps open between chunks (least recently used go)
CHUNK_S = 0.02  # a chunk ends once reading it took this long (slow reads: a few per round trip),
CHUNK_BYTES = 4 << 20  # or at about this many bytes of tensors and arrays (or at its count)
_SIZE_EVERY = 8  # the chunk's size counts every item as the last one measured, measuring every 8th


class StaleChunk:
    """A worker's answer to a chunk that goes on after chunk ``k`` where it does not hold the
    reader's inner iterator there: nothing was read; ask again with the state after chunk ``k``."""

    __slots__ = ()


class InnerChunkTask:
    """Runs in a worker: read chunk ``chunk`` of inner dataset ``seq`` for reader ``reader_id``.

    A chunk ends at ``count`` items (at least ``block_length``), after ``CHUNK_S`` seconds of
    reading or at ``CHUNK_BYTES``, whichever comes first: one round trip carries many cheap items
    or several slow reads, and little memory.

    A worker that holds the reader's inner iterator after chunk ``chunk - 1`` reads on from it.
    Otherwise a chunk that ``follows`` the one before it (sent before that one's state was known)
    waits while chunk ``chunk - 1`` is due in this worker (:meth:`queued`) and reads on after it,
    or else answers :class:`StaleChunk`; any other chunk opens the inner dataset at ``state``.
    Returns a list of ``(kind, payload, inner_state_after)``, the state taken once, after the
    chunk's last element (the others carry None), ending with an ``END`` item if the inner
    dataset ended; a chunk of values of one flat structure comes as a :class:`PackedChunk`.
    Worker processes inherit the task through fork (Ray actors get it pickled).
    """

    def __init__(self, opener: InnerOpener) -> None:
        self.opener = opener
        # reader_id -> (the chunk it reads next, iterator), least recently used first
        self._open: OrderedDict[int, tuple[int, Iterator]] = OrderedDict()
        self._due: Counter[tuple[int, int]] = Counter()  # (reader_id, chunk) arrived, not done
        self._lock = threading.Lock()
        # reader_id -> (woken when its chunk is done, threads waiting): one reader's, not all
        self._waiting: dict[int, tuple[threading.Condition, int]] = {}

    def start_worker(self, slot: int) -> None:
        self.opener.seed_worker(slot)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a Ray actor: the opener; the inner datasets kept open stay here."""
        return {"opener": self.opener}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["opener"])  # type: ignore[misc]  # this class's own __init__

    def queued(self, task_id: int, payload: tuple) -> None:
        """Called on the worker's main thread as each chunk arrives, in order, before any thread
        runs it: a chunk that follows it waits for it here rather than answer stale."""
        with self._lock:
            self._due[payload[4], payload[5]] += 1

    def __call__(self, task_id: int, payload: tuple) -> list[Item] | PackedChunk | StaleChunk:
        element, seq, state, count, reader_id, chunk, follows = payload
        kept = None
        try:
            iterator, other = self._claim(reader_id, chunk, follows)
            if other is not None:
                other.close()  # kept at another chunk: this one opens at its state
            if iterator is None and follows:
                return StaleChunk()
            if iterator is None:
                iterator = self.opener(element, seq, state)
            try:
                items = _read_chunk(iterator, count)
            except BaseException:
                iterator.close()
                raise
            if items and items[-1][0] == END:
                iterator.close()
            else:
                kept = iterator
            return _packed(items)
        finally:
            self._done(reader_id, chunk, kept)

    def _claim(
        self, reader_id: int, chunk: int, follows: bool
    ) -> tuple[Iterator | None, Iterator | None]:
        """``(the iterator after chunk - 1 or None, one kept at another chunk that a chunk with a
        state replaces, for the caller to close)``; a chunk that follows waits for chunk - 1."""
        with self._lock:
            while True:
                kept = self._open.get(reader_id)
                if kept is not None and kept[0] == chunk:
                    del self._open[reader_id]
                    return kept[1], None
                if not follows or self._due[reader_id, chunk - 1] <= 0:
                    break
                self._wait(reader_id)
            other = None if follows else self._open.pop(reader_id, None)
        return None, other[1] if other is not None else None

    def _wait(self, reader_id: int) -> None:
        """Wait (holding ``_lock``) until a chunk of the reader is done, or ``_WAIT_S``."""
        condition, count = self._waiting.get(reader_id, (None, 0))
        if condition is None:
            condition = threading.Condition(self._lock)
        self._waiting[reader_id] = (condition, count + 1)
        t0 = time.perf_counter()
        try:
            condition.wait(_WAIT_S)
        finally:
            condition, count = self._waiting.pop(reader_id)
            if count > 1:
                self._waiting[reader_id] = (condition, count - 1)
        waited(time.perf_counter() - t0)

    def _done(self, reader_id: int, chunk: int, iterator: Iterator | None) -> None:
        """Chunk ``chunk`` is done: keep ``iterator`` (None: it ended, failed or was not read)
        for the next."""
        evicted = []
        with self._lock:
            key = (reader_id, chunk)
            if self._due[key] > 1:
                self._due[key] -= 1
            else:
                self._due.pop(key, None)
            if iterator is not None:
                replaced = self._open.pop(reader_id, None)  # a stray: chunks of a reader take turns
                if replaced is not None:
                    evicted.append(replaced[1])
                self._open[reader_id] = (chunk + 1, iterator)
                while len(self._open) > _KEPT_OPEN:
                    evicted.append(self._open.popitem(last=False)[1][1])
            waiting = self._waiting.get(reader_id)
            if waiting is not None:
                waiting[0].notify_all()
        for oldest in evicted:
            oldest.close()


def _read_chunk(iterator: Iterator, count: int) -> list[Item]:
    """Up to ``count`` items of ``iterator`` (at least one), until ``CHUNK_S`` or ``CHUNK_BYTES``.

    Only the chunk's last element or error carries the inner state after it (one
    ``state_dict()`` a chunk); the others carry None, and the reader places them
    (:meth:`_ChunkReader.receive`)."""
    items: list[Item] = []
    deadline, nbytes, size = time.perf_counter() + CHUNK_S, 0, 0
    while len(items) < count and (
        (nbytes < CHUNK_BYTES and time.perf_counter() < deadline) or not items
    ):
        try:
            value = next(iterator)
        except StopIteration:
            items.append((END, None, None))
            break
        except Exception as e:  # noqa: BLE001 - delivered in its place
            items.append((ERROR, e, None))
            continue
        if len(items) % _SIZE_EVERY == 0:  # sizes of a stream's items change slowly
            size = element_bytes(value)
        items.append((VALUE, value, None))
        nbytes += size
    last = len(items) - 1 - (bool(items) and items[-1][0] == END)
    if last >= 0:
        kind, payload, _ = items[last]
        items[last] = (kind, payload, iterator.state_dict())
    return items


class PackedChunk:
    """A chunk of values only (perhaps then the end), with the values sent as columns and the
    inner state after the last one."""

    __slots__ = ("values", "count", "state", "ended")

    def __init__(self, values: Columns, count: int, state: Any, ended: bool) -> None:
        self.values, self.count, self.state, self.ended = values, count, state, ended

    def __len__(self) -> int:
        """Items in the chunk, as :meth:`items` lists them."""
        return self.count + self.ended

    def items(self) -> list[Item]:
        """The chunk as :class:`InnerChunkTask` read it."""
        items: list[Item] = [(VALUE, value, None) for value in self.values.rows()]
        if items:
            items[-1] = (VALUE, items[-1][1], self.state)
        return items + [(END, None, None)] if self.ended else items


def _packed(items: list[Item]) -> list[Item] | PackedChunk:
    """``items`` as a :class:`PackedChunk` where its values go as columns, else as they are."""
    ended = bool(items) and items[-1][0] == END
    values = items[:-1] if ended else items
    if any(kind != VALUE for kind, _, _ in values):
        return items
    columns = to_columns([value for _, value, _ in values])
    return (
        items
        if columns is None
        else PackedChunk(columns, len(values), values[-1][2] if values else None, ended)
    )

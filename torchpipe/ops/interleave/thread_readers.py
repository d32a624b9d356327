"""Interleave readers on a thread pool: each open inner dataset is read ahead by pool tasks.

A reader's task reads up to ``_READS_PER_TASK`` items, then goes to the back of the pool's queue,
so readers take turns on the threads. Each item waits in the reader until the consumer takes it;
the consumer takes every item a reader has ready at once, under one lock, and hands them out one by
one without it (#59: a lock, or three, an element was most of what a cheap element cost), with its
position: the inner iterator's state at the start of the task and the items read since
(``readers.items_after``; one ``state_dict()`` a task, not one an item). Every read is marked
on the runtime's stall watch (:class:`~torchpipe.runtime.stall.StallWatch`), so a read that never
returns raises ``StallError`` naming the stage, the inner dataset and the thread, as the
dispatcher's tasks do.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torchpipe.core.iterator import Iterator
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
    read_on_from,
)
from torchpipe.runtime.placement.costs import THREAD
from torchpipe.runtime.stall import StallWatch
from torchpipe.runtime.thread_pool import ThreadPool
from torchpipe.runtime.timing import CallClock

_WAIT_S = 0.5  # one wait's step: the stall limit is checked between steps
_READS_PER_TASK = 32  # then the task goes to the back of the pool's queue: readers take turns
_PUSH_EVERY = 16  # items a task hands over at once (at once where the consumer has none left)
_STOP_S = 0.1  # how long release() waits for reads in progress


class _ThreadReader(Reader):
    """One inner dataset read ahead on the pool.

    At most one pool task at a time touches the inner iterator. Items wait in ``ready`` (guarded
    by the pool's ``wakeup`` condition) until the consumer takes them. The reader holds no
    reference to the interleave iterator, so an abandoned one can be collected.
    """

    __slots__ = (
        "ready",
        "mine",
        "taken_state",
        "_pool",
        "_read_state",
        "_iterator",
        "_done",
        "_running",
        "_stopped",
        "_closed",
        "_future",
    )

    def __init__(
        self,
        pool: ThreadReaders,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None,
        error: BaseException | None,
        read_ahead: tuple[Item, ...],
    ) -> None:
        super().__init__(element, seq, error)
        self.ready: deque[Item] = deque(read_ahead)
        # taken from ready by the consumer, not yet handed out (the consumer's thread only)
        self.mine: deque[Item] = deque()
        self.taken_state = inner  # inner state after the last item the consumer took
        self._pool = pool
        self._read_state = read_on_from(inner, read_ahead)  # where the inner iterator opens
        self._iterator: Iterator | None = None
        ended = bool(read_ahead) and read_ahead[-1][0] == END
        self._done = error is not None or ended  # nothing more will be read
        self._running = False
        self._stopped = False  # read nothing more
        self._closed = False  # and keep nothing more
        self._future: Future | None = None
        if error is not None:
            self.ready.append((FAILED, error, None))

    # -- consumer side ---------------------------------------------------------------------
    def refill(self) -> None:
        """Start a read-ahead task unless one runs, the reader is done, or it is full (reading
        on as soon as there is room keeps a slow source's next read in flight)."""
        pool = self._pool
        with pool.wakeup:
            threads = pool.threads
            if (
                threads is None
                or self._running
                or self._stopped
                or self._done
                or self.held() >= pool.capacity
            ):
                return
            self._running = True
        try:
            self._future = threads.submit(self._read_ahead)
        # the threads were closed meanwhile (the pass ended): nothing to read for
        except RuntimeError:
            with pool.wakeup:
                self._running = False

    def held(self) -> int:
        """Items read and not handed out: ready, and taken by the consumer (its length is read
        from the pool's threads too: one read of a deque's length)."""
        return len(self.ready) + len(self.mine)

    def stop(self, deadline: float) -> None:
        """Stop reading and wait (until ``deadline``, a ``perf_counter`` time) for a running task
        to end; what was read stays ready."""
        wakeup = self._pool.wakeup
        with wakeup:
            self._stopped = True
            if self._running and self._future is not None and self._future.cancel():
                self._running = False
            while self._running and time.perf_counter() < deadline:
                wakeup.wait(timeout=max(0.0, deadline - time.perf_counter()))

    def place(self) -> ReaderPlace:
        """Where the stopped reader stands, with what it read and was not taken, as exactly as a
        state: the inner iterator's own after the last item read (not a position in its task), so
        a successor reads nothing again. Nothing read ahead if opening failed, or if a read still
        runs (:meth:`stop` did not wait long enough): the successor reads again from the items taken."""
        with self._pool.wakeup:
            items = [*self.mine, *self.ready]
            if self._running or any(kind == FAILED for kind, _, _ in items):
                return ReaderPlace(self.element, self.seq, self.taken_state, self.error)
        taken = self.taken_state
        if self._iterator is not None and not (items and items[-1][0] == END):
            try:
                state = self._iterator.state_dict()
            except Exception:  # noqa: BLE001 - the positions it has stand
                state = None
            if state is not None and items:
                kind, payload, _ = items[-1]
                items[-1] = (kind, payload, state)
            elif state is not None:
                taken = state
        return ReaderPlace(self.element, self.seq, taken, self.error, tuple(items))

    def close(self) -> None:
        """Stop reading; the inner iterator is closed now, or by the running task as it ends."""
        with self._pool.wakeup:
            self._stopped = self._closed = True
            self.ready.clear()
            self.mine.clear()
            close_now = not self._running or (self._future is not None and self._future.cancel())
            self._running = self._running and not close_now
        if close_now and self._iterator is not None:
            self._iterator.close()

    # -- pool side -------------------------------------------------------------------------
    def _read_ahead(self) -> None:
        pool = self._pool
        where = f"thread {threading.current_thread().name}"
        more = close_now = False
        try:
            if self._iterator is None and not self._open(where):
                return
            reads = self._read_task(where)
            more = reads == _READS_PER_TASK
            if reads:  # one state a task: the next task's items stand after it
                self._take_state()
        finally:
            pool.watch.end(self.seq)
            with pool.wakeup:
                self._running = False
                close_now = self._stopped
                pool.wakeup.notify_all()
            if close_now and self._iterator is not None:
                self._iterator.close()
        if more and not close_now:
            self.refill()  # behind the other readers' tasks

    def _take_state(self) -> None:
        assert self._iterator is not None  # it read
        try:
            self._read_state = self._iterator.state_dict()
        except Exception as e:  # noqa: BLE001 - the machinery failed, not one element
            self._push([(FAILED, e, None)], done=True)

    def _open(self, where: str) -> bool:
        self._pool.watch.begin(self.seq, where)
        try:
            self._iterator = self._pool.opener(self.element, self.seq, self._read_state)
        except Exception as e:  # noqa: BLE001 - the reader fails with it, in its place
            self._push([(FAILED, e, None)], done=True)
            return False
        return True

    def _read_task(self, where: str) -> int:
        """Read up to ``_READS_PER_TASK`` items, while the reader may hold more, and hand them
        over in lots of up to ``_PUSH_EVERY`` (at once where the consumer has none left); the
        items read (values and errors)."""
        pool = self._pool
        iterator, calls = self._iterator, pool.stats.calls
        assert iterator is not None and calls is not None  # opened; the stage's calls counted
        reads, ended = 0, False
        lot: list[Item] = []
        clock: CallClock | None = None  # since the lot's first read
        while reads < _READS_PER_TASK and not ended:
            if self._stopped or self.held() + len(lot) >= pool.capacity:
                break  # read without the lock: at worst one item more, kept as read
            if clock is None:
                pool.watch.begin(self.seq, where)
                clock = CallClock()
            try:
                kind, payload = VALUE, next(iterator)
                reads += 1
            except StopIteration:
                kind, payload, ended = END, None, True
            except Exception as e:  # noqa: BLE001 - this element's error, delivered in its place
                kind, payload = ERROR, e
                reads += 1
            lot.append((kind, payload, items_after(self._read_state, reads) if not ended else None))
            if ended or len(lot) >= _PUSH_EVERY or not (self.ready or self.mine):
                calls.add_call(clock, items=len(lot))
                self._push(lot, done=ended)
                lot, clock = [], None
        if clock is not None:
            calls.add_call(clock, items=len(lot))
            self._push(lot)
        return reads

    def _push(self, items: list[Item], done: bool = False) -> None:
        wakeup = self._pool.wakeup
        with wakeup:
            if not self._closed:  # an item read as the reader stopped is kept: it was read
                self.ready.extend(items)
            self._done = self._done or done
            wakeup.notify_all()


class ThreadReaders(ReaderPool[_ThreadReader]):
    """Reads the open inner datasets ahead on a pool of ``parallelism`` threads.

    Args:
        name: the stage name (thread names, errors).
        opener: builds an inner iterator from an input element.
        block_length: the interleave's; a reader holds at least two blocks ready.
        stall_s: ``Options.stall_timeout``: a read that runs this long raises ``StallError``.
    """

    kind = THREAD

    def __init__(
        self, name: str, opener: InnerOpener, block_length: int, stall_s: float | None
    ) -> None:
        self.name = name
        self.opener = opener
        self.watch = StallWatch(name, stall_s, label="a read of inner dataset")
        self.wakeup = threading.Condition()  # notified whenever an item is ready or a task ends
        self.threads: ThreadPool | None = None
        self._usual = min(max(32, 2 * block_length), 64)
        # items each reader may hold ready; open readers see a change at once
        self.capacity = self._usual

    def start(self, parallelism: int) -> None:
        self.threads = ThreadPool(parallelism, self.name)

    def resize(self, parallelism: int) -> None:
        if self.threads is not None:
            self.threads.resize(parallelism)

    def set_read_ahead(self, items: int) -> None:
        self.capacity = max(self._usual, items)

    def reader_capacity(self) -> int:
        return self.capacity

    def report(self) -> dict[str, Any]:
        return {"workers": self.threads.size} if self.threads is not None else {}

    def open(
        self,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None = None,
        error: BaseException | None = None,
        read_ahead: tuple[Item, ...] = (),
    ) -> _ThreadReader:
        return _ThreadReader(self, element, seq, inner, error, read_ahead)

    def read(self, reader: _ThreadReader) -> None:
        reader.refill()

    def has_ready(self, reader: _ThreadReader) -> bool:
        if reader.mine:
            return True
        with self.wakeup:
            return bool(reader.ready)

    def take(self, reader: _ThreadReader) -> tuple[str, Any]:
        mine = reader.mine
        if not mine:
            self._take_ready(reader)
        kind, payload, state = mine.popleft()
        if kind in (VALUE, ERROR):
            reader.taken_state = state
            if len(mine) == self.capacity // 2:
                reader.refill()  # half of what it may hold handed out: read on meanwhile
        return kind, payload

    def _take_ready(self, reader: _ThreadReader) -> None:
        """Move every item the reader has ready to the consumer's side, waiting for one."""
        t0 = time.perf_counter()
        with self.wakeup:
            while not reader.ready:
                reader.refill()  # a reader restored or moved here asks now, if it has not
                self.wakeup.wait(timeout=_WAIT_S)
                if not reader.ready:
                    self.watch.check()
            ready = len(reader.ready)
            reader.mine.extend(reader.ready)
            reader.ready.clear()
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.look(ready, self.capacity)
        reader.refill()

    def wait(self, until: Callable[[], bool]) -> None:
        with self.wakeup:  # readers push under it: nothing is missed between the look and the wait
            if until():
                return
            self.wakeup.wait(timeout=_WAIT_S)
            if not until():
                self.watch.check()

    def inner_state(self, reader: _ThreadReader) -> dict[str, Any] | None:
        return reader.taken_state

    def close(self, reader: _ThreadReader) -> None:
        reader.close()

    def release(self, readers: list[_ThreadReader], others_stay: bool = False) -> list[ReaderPlace]:
        deadline = time.perf_counter() + _STOP_S
        for reader in readers:
            reader.stop(deadline)
        places = [reader.place() for reader in readers]
        for reader in readers:
            reader.close()
        # no reader is left here (unless others stay and read on): a read still running must not
        # hold the move up
        if self.threads is not None and not others_stay:
            self.threads.close(wait=False)
            self.threads = None
        return places

    def park(self) -> None:
        self.shutdown()  # threads are cheap to start again

    def shutdown(self) -> None:
        if self.threads is not None:
            self.threads.close()
            self.threads = None

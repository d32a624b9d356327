"""Interleave readers on a thread pool: each open inner dataset is read ahead by pool tasks.

A reader's task reads up to ``_READS_PER_TASK`` items, then goes to the back of the pool's queue,
so readers take turns on the threads. Each item waits in the reader until the consumer takes it,
with its position: the inner iterator's state at the start of the task and the items read since
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
from torchpipe.runtime.placement.policy import THREAD
from torchpipe.runtime.stall import StallWatch
from torchpipe.runtime.thread_pool import ThreadPool
from torchpipe.runtime.timing import CallClock

_WAIT_S = 0.5  # one wait's step: the stall limit is checked between steps
_READS_PER_TASK = 32  # then the task goes to the back of the pool's queue: readers take turns
_STOP_S = 0.1  # how long release() waits for reads in progress


class _ThreadReader(Reader):
    """One inner dataset read ahead on the pool.

    At most one pool task at a time touches the inner iterator. Items wait in ``ready`` (guarded
    by the pool's ``wakeup`` condition) until the consumer takes them. The reader holds no
    reference to the interleave iterator, so an abandoned one can be collected.
    """

    __slots__ = (
        "ready",
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
                or len(self.ready) >= pool.capacity
            ):
                return
            self._running = True
        try:
            self._future = threads.submit(self._read_ahead)
        # the threads were closed meanwhile (the pass ended): nothing to read for
        except RuntimeError:
            with pool.wakeup:
                self._running = False

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
            if self._running or any(kind == FAILED for kind, _, _ in self.ready):
                return ReaderPlace(self.element, self.seq, self.taken_state, self.error)
            items = list(self.ready)
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
            reads = 0
            while reads < _READS_PER_TASK and self._read_one(where, reads + 1):
                reads += 1
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
            self._push(FAILED, e, None, done=True)

    def _open(self, where: str) -> bool:
        self._pool.watch.begin(self.seq, where)
        try:
            self._iterator = self._pool.opener(self.element, self.seq, self._read_state)
        except Exception as e:  # noqa: BLE001 - the reader fails with it, in its place
            self._push(FAILED, e, None, done=True)
            return False
        return True

    def _read_one(self, where: str, k: int) -> bool:
        """Read the task's ``k``-th item; whether reading may go on."""
        pool = self._pool
        with pool.wakeup:
            if self._stopped or len(self.ready) >= pool.capacity:
                return False
        pool.watch.begin(self.seq, where)
        clock = CallClock()
        iterator, calls = self._iterator, pool.stats.calls
        assert iterator is not None and calls is not None  # opened; the stage's calls counted
        try:
            kind, payload = VALUE, next(iterator)
        except StopIteration:
            kind, payload = END, None
        except Exception as e:  # noqa: BLE001 - this element's error, delivered in its place
            kind, payload = ERROR, e
        calls.add_call(clock, items=1)
        state = items_after(self._read_state, k) if kind != END else None
        self._push(kind, payload, state, done=kind == END)
        return kind in (VALUE, ERROR)

    def _push(self, kind: str, payload: Any, state: Any, done: bool = False) -> None:
        wakeup = self._pool.wakeup
        with wakeup:
            if not self._closed:  # an item read as the reader stopped is kept: it was read
                self.ready.append((kind, payload, state))
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
        with self.wakeup:
            return bool(reader.ready)

    def take(self, reader: _ThreadReader) -> tuple[str, Any]:
        t0 = time.perf_counter()
        with self.wakeup:
            while not reader.ready:
                reader.refill()  # a reader restored or moved here asks now, if it has not
                self.wakeup.wait(timeout=_WAIT_S)
                if not reader.ready:
                    self.watch.check()
            ready = len(reader.ready)
            kind, payload, state = reader.ready.popleft()
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.look(ready, self.capacity)
        if kind in (VALUE, ERROR):
            reader.taken_state = state
            reader.refill()
        return kind, payload

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

    def release(self, readers: list[_ThreadReader]) -> list[ReaderPlace]:
        deadline = time.perf_counter() + _STOP_S
        for reader in readers:
            reader.stop(deadline)
        places = [reader.place() for reader in readers]
        for reader in readers:
            reader.close()
        # no reader is left here: a read still running must not hold the move up
        if self.threads is not None:
            self.threads.close(wait=False)
            self.threads = None
        return places

    def park(self) -> None:
        self.shutdown()  # threads are cheap to start again

    def shutdown(self) -> None:
        if self.threads is not None:
            self.threads.close()
            self.threads = None

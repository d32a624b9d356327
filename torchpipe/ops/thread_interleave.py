"""``interleave(..., num_parallel_calls=N)`` on threads: open inner datasets read ahead on a pool."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from torchpipe.errors import StallError
from torchpipe.ops.base import Iterator, PositionLog
from torchpipe.ops.interleave_base import _END, _ERROR, _FAILED, _VALUE, InnerOpener, ReadAheadInterleave
from torchpipe.runtime.thread_pool import ThreadPool
from torchpipe.runtime.timing import CallTiming

_WAIT_S = 0.5
_READS_PER_TASK = 32  # then the task goes to the back of the pool's queue: readers take turns
_STOP_S = 0.1  # how long stop_reading() waits for reads in progress


class ReadAhead:
    """How many elements each reader may read ahead; shared by the readers of one iterator, so
    a change reaches the open ones too."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity


class _InnerReader:
    """One inner dataset of the parallel iterator: opened and read ahead on the pool.

    At most one pool task at a time touches the inner iterator. Finished items wait in
    ``ready`` (guarded by the shared ``wakeup`` condition) until the consumer takes them; a
    :class:`PositionLog` over the inner iterator maps "taken so far" to an inner state. The
    reader holds no reference to the interleave iterator, so an abandoned one can be collected.

    Args:
        element: the input element the inner dataset is made from.
        seq: its sequence number.
        state: the inner state to resume from, or None for a fresh start.
        opener: builds the inner iterator.
        wakeup: notified whenever an item is ready or a task ends.
        read_ahead: how many items to read ahead.
        timing: where the cost of each read is added up.
        error: an input error to deliver instead of opening anything.
    """

    def __init__(
        self,
        element: Any,
        seq: int,
        state: dict[str, Any] | None,
        opener: InnerOpener,
        wakeup: threading.Condition,
        read_ahead: ReadAhead,
        timing: CallTiming,
        error: BaseException | None = None,
    ) -> None:
        self.element = element
        self.seq = seq
        self.initial_state = state
        self.error = error
        self.taken = 0
        self.ready: deque[tuple[str, int, Any]] = deque()
        self.log: PositionLog | None = None
        self._opener = opener
        self._wakeup = wakeup
        self._ahead = read_ahead
        self._timing = timing
        self._iterator: Iterator | None = None
        self._done = error is not None  # nothing more will be read
        self._running = False
        self._stopped = False  # read nothing more
        self._closed = False  # and keep nothing more
        self._future: Future | None = None
        self._pool: ThreadPool | None = None
        if error is not None:
            self.ready.append((_FAILED, -1, error))

    # -- consumer side ---------------------------------------------------------------------
    def refill(self, pool: ThreadPool) -> None:
        """Start a read-ahead task unless one runs, the reader is done, or it is full (reading
        on as soon as there is room keeps a slow source's next read in flight)."""
        with self._wakeup:
            if self._running or self._stopped or self._done or len(self.ready) >= self._ahead.capacity:
                return
            self._running = True
        self._pool = pool
        try:
            self._future = pool.submit(self._read_ahead)
        except RuntimeError:  # the pool closed (the pass ended or was closed): nothing to read for
            with self._wakeup:
                self._running = False

    def has_ready(self) -> bool:
        with self._wakeup:
            return bool(self.ready)

    def take(self, stage: str, stall_s: float | None) -> tuple[str, Any, int]:
        """The next item and how many were ready, waiting (in bounded steps) until the pool has
        produced it.

        Raises:
            StallError: after ``stall_s`` seconds without an item.
        """
        with self._wakeup:
            since = time.monotonic()
            while not self.ready:
                self._wakeup.wait(timeout=_WAIT_S)
                if not self.ready and stall_s is not None and time.monotonic() - since > stall_s:
                    raise StallError(
                        f"{stage}: inner dataset {self.seq} has given no element for {stall_s:g} s "
                        f"({'a read runs on a pool thread' if self._running else 'no read is running'}; "
                        "tp.Options(stall_timeout=None) turns the check off)",
                        stage=stage, seq=self.seq, where="a thread of the interleave's pool",
                    )  # fmt: skip
            ready = len(self.ready)
            kind, seq, payload = self.ready.popleft()
        if kind in (_VALUE, _ERROR):
            self.log.delivered(seq)
            self.taken += 1
        return kind, payload, ready

    def inner_state(self) -> dict[str, Any] | None:
        """The inner iterator's state after the items taken so far."""
        if self.taken == 0:
            return self.initial_state
        return self.log.state()["input"]

    def stop(self, deadline: float) -> None:
        """Stop reading and wait (until ``deadline``, a ``perf_counter`` time) for a running task
        to end; what was read stays ready."""
        with self._wakeup:
            self._stopped = True
            if self._running and self._future is not None and self._future.cancel():
                self._running = False
            while self._running and time.perf_counter() < deadline:
                self._wakeup.wait(timeout=max(0.0, deadline - time.perf_counter()))

    def read_ahead(self) -> list[tuple[str, Any, Any]]:
        """What was read but not taken, as ``(kind, payload, inner state after)`` items; empty if
        opening failed, or if a read still runs (:meth:`stop` did not wait long enough): the
        successor reads again from the items taken."""
        with self._wakeup:
            if self._running:
                return []
        items = []
        for kind, seq, payload in self.ready:
            if kind == _FAILED:
                return []
            items.append((kind, None, None) if kind == _END else (kind, payload, self.log.state_after(seq)))
        return items

    def close(self) -> None:
        """Stop reading; the inner iterator is closed now, or by the running task as it ends."""
        with self._wakeup:
            self._stopped = self._closed = True
            self.ready.clear()
            close_now = not self._running or (self._future is not None and self._future.cancel())
            self._running = self._running and not close_now
        if close_now and self._iterator is not None:
            self._iterator.close()

    # -- pool side -------------------------------------------------------------------------
    def _read_ahead(self) -> None:
        more = False
        try:
            if self._iterator is None and not self._open():
                return
            reads = 0
            while reads < _READS_PER_TASK and self._read_one():
                reads += 1
            more = reads == _READS_PER_TASK
        finally:
            with self._wakeup:
                self._running = False
                close_now = self._stopped
                self._wakeup.notify_all()
            if close_now and self._iterator is not None:
                self._iterator.close()
        if more and not close_now:
            self.refill(self._pool)  # behind the other readers' tasks

    def _open(self) -> bool:
        try:
            iterator = self._opener(self.element, self.seq, self.initial_state)
        except Exception as e:
            self._push(_FAILED, -1, e, done=True)
            return False
        self._iterator = iterator
        self.log = PositionLog(iterator)
        return True

    def _read_one(self) -> bool:
        with self._wakeup:
            if self._stopped or len(self.ready) >= self._ahead.capacity:
                return False
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            seq, value, error = self.log.pull()
        except StopIteration:
            self._push(_END, -1, None, done=True)
            return False
        except Exception as e:  # the machinery failed (e.g. state_dict), not one element
            self._push(_FAILED, -1, e, done=True)
            return False
        finally:
            self._timing.add(time.perf_counter() - wall, time.thread_time() - cpu, items=1)
        kind, payload = (_VALUE, value) if error is None else (_ERROR, error)
        self._push(kind, seq, payload)
        return True

    def _push(self, kind: str, seq: int, payload: Any, done: bool = False) -> None:
        with self._wakeup:
            if not self._closed:  # an item pulled as the reader stopped is kept: it was read
                self.ready.append((kind, seq, payload))
            self._done = self._done or done
            self._wakeup.notify_all()


class ThreadInterleaveIterator(ReadAheadInterleave):
    """Reads the open inner datasets ahead on a thread pool, and pre-opens the next ones.

    Input elements are pulled on the consumer's thread, in order, and handed to slots first
    in first out, so the deterministic order is exactly the inline one. Without determinism,
    a slot with nothing ready is passed over for one that has something. Read-ahead is not
    state: the checkpoint holds what the consumer has taken (see :class:`PositionLog`).

    Args:
        name: the stage name.
        source: the input iterator.
        opener: builds an inner iterator from an input element.
        cycle_length: number of inner datasets open at once.
        block_length: consecutive elements taken from one before moving to the next.
        parallelism: number of pool threads.
        deterministic: whether to keep the inline order.
        tunable: let the autotuner change ``parallelism``.
        stall_s: ``Options.stall_timeout``: a slot that gives nothing this long raises ``StallError``.
    """

    def __init__(
        self,
        name: str,
        source: Iterator,
        opener: InnerOpener,
        cycle_length: int,
        block_length: int,
        parallelism: int,
        deterministic: bool,
        tunable: bool = False,
        stall_s: float | None = None,
    ) -> None:
        super().__init__(name, source, opener, cycle_length, block_length, parallelism, tunable)
        self._deterministic = deterministic
        self._stall_s = stall_s
        self._usual_read_ahead = min(max(32, 2 * block_length), 64)
        self._read_ahead = ReadAhead(self._usual_read_ahead)
        self._wakeup = threading.Condition()

    def buffer_slots(self) -> int:
        return (self._cycle_length + self._lookahead) * self._read_ahead.capacity

    def start(self) -> None:
        self._pool = ThreadPool(self._parallelism, self.name)
        for reader in self._slots:
            if reader is not None:
                reader.refill(self._pool)

    def next(self) -> Any:
        try:
            return super().next()
        except StopIteration:
            self._pool.close()  # the pass is over: free the threads now rather than at close()
            raise

    def _start_reading(self, reader: _InnerReader) -> None:
        reader.refill(self._pool)  # then it refills as it is taken from

    def _new_reader(
        self, element: Any, seq: int, state: dict[str, Any] | None, error: BaseException | None
    ) -> _InnerReader:
        return _InnerReader(element, seq, state, self._opener, self._wakeup, self._read_ahead, self.stats.calls, error)

    def _take(self, reader: _InnerReader) -> tuple[str, Any]:
        t0 = time.perf_counter()
        kind, payload, ready = reader.take(self.name, self._stall_s)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.look(ready, self._read_ahead.capacity)
        if kind in (_VALUE, _ERROR):
            reader.refill(self._pool)
        return kind, payload

    def _choose_slot(self) -> None:
        if self._deterministic:
            return
        t0 = time.perf_counter()
        with self._wakeup:
            while True:
                index = self._servable_slot()
                if index is not None:
                    break
                self._wakeup.wait(timeout=_WAIT_S)
                if self._stall_s is not None and time.perf_counter() - t0 > self._stall_s:
                    raise StallError(f"{self.name}: no inner dataset has given an element for {self._stall_s:g} s "
                                     "(tp.Options(stall_timeout=None) turns the check off)", stage=self.name)
        self.stats.wait_s += time.perf_counter() - t0
        self._serve(index)

    def _has_ready(self, reader: _InnerReader) -> bool:
        return reader.has_ready()

    def _set_read_ahead(self, items: int) -> None:
        self._read_ahead.capacity = max(self._usual_read_ahead, items)

    def stop_reading(self, timeout: float = _STOP_S) -> None:
        """Stop every reader, keeping what it read ahead for :meth:`hand_over`; a reader whose
        read outlasts ``timeout`` hands over nothing read ahead (a slow read does not hold up
        the handover)."""
        deadline = time.perf_counter() + timeout
        for reader in [*self._slots, *self._futures]:
            if reader is not None:
                reader.stop(deadline)

    def _read_ahead_of(self, reader: _InnerReader) -> list[tuple[str, Any, Any]]:
        return reader.read_ahead()

    def _close_slot(self, reader: _InnerReader) -> None:
        reader.close()

    def _slot_state(self, reader: _InnerReader) -> dict[str, Any]:
        return {self.ELEMENT: reader.element, self.SEQ: reader.seq, self.INNER: reader.inner_state()}

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.close()
        super().shutdown()
        while self._futures:
            self._futures.popleft().close()

"""The loop a worker process runs: take a task, run the handler, write the result to shared memory.

Protocol on the worker's channel (see ``docs/process_pool.md``)::

    worker -> main  ("ring_added", index)                + a ring's fd (its first, and more later)
    main -> worker  ("tasks", [(seq, payload), ...])     run in order (or on the worker's threads)
                    ("threads", n)                       run up to n tasks at once, on threads
                    ("stop",)                            stop the threads and exit (no task in flight)
    worker -> main  ("ring", seq, index, offset, nbytes, *cost)   result encoded in ring ``index``
                    ("segment", seq, nbytes, *cost)              + fd: a result too large for the rings
                    ("error", seq, packed_exception, *cost)

``cost`` is ``(start, wall_s, cpu_s, counts)``: when the task started, what it cost the worker (the
call and writing its result; CPU time of the thread that ran it: the autotuner's measure of the
stage), and what it counted (:mod:`~torchpipe.runtime.counts`; None when nothing).

Until a worker is sent ``("threads", n)`` with ``n > 1`` it runs tasks on its main thread, in
order. From then on its main thread only receives messages and its tasks go to a local queue
served by ``n`` threads, so the handler is called concurrently and must be thread-safe.
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import torch

from torchpipe.errors import add_note
from torchpipe.runtime import codec
from torchpipe.runtime.counts import COUNTS, Tally
from torchpipe.runtime.processes.channel import Channel, ChannelClosed
from torchpipe.runtime.processes.shm_ring import OneOffSegment, Reservation, ShmRing

_POLL_S = 0.5
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters
MAX_RING_BYTES = 512 << 20
"""A worker's rings together hold at most this; results beyond go to one-off segments."""
_MIN_RING_BYTES = 16 << 20
_RESULTS_PER_RING = 2
_RING_GRACE_S = 0.002  # a ring freed this soon is worth waiting for rather than adding one
_GROW_AFTER, _MISS_WINDOW = 4, 16  # of the last 16 records, 4 that found no room in a ring add one
_JOIN_S = 2.0  # how long a stopping worker waits for its task threads

Handler = Callable[[int, Any], Any]


def run_worker(
    channel: Channel,
    worker_id: int,
    handler: Handler,
    ring_capacity: int,
    ring_limit: int = MAX_RING_BYTES,
    keep_freed: bool = True,
) -> None:
    """Serve tasks until told to stop, the channel closes, or the parent process is gone.

    Args:
        worker_id: the worker's slot, 0..size-1 (a replacement gets its predecessor's).
        ring_capacity: the first ring's bytes; ring_limit: the most the worker's rings hold in all.
        keep_freed: keep freed memory for reuse (:func:`keep_freed_memory`) rather than return it.
        handler: ``handler(seq, payload)`` per task; if it has ``start_worker(worker_id)``,
            that runs first. After a ``("threads", n)`` message with ``n > 1`` it is called
            from up to ``n`` threads at once, so it must then be thread-safe.
    """
    torch.set_num_threads(1)  # one worker, one core; the pool provides the parallelism
    if keep_freed:
        keep_freed_memory()
    start = getattr(handler, "start_worker", None)
    if start is not None:
        start(worker_id)  # per-worker setup (torch's worker seeding, worker_init_fn, ...)
    parent = os.getppid()
    output = _Output(channel, min(ring_capacity, ring_limit), ring_limit)
    tasks = _TaskRunner(handler, output)
    try:
        while os.getppid() == parent:
            if not channel.poll(_POLL_S):
                continue
            message, _ = channel.recv()
            if message[0] == "threads":
                tasks.set_threads(message[1])
            elif message[0] == "tasks":
                tasks.run(message[1])
            else:
                return
    except ChannelClosed:
        return
    finally:
        tasks.stop(_JOIN_S)
        output.close()


def keep_freed_memory() -> None:
    """Make glibc's malloc reuse freed memory in this worker instead of returning it.

    By default every allocation of 32 MB or more (and, after a while, of less) is a fresh
    ``mmap``: each new tensor then pays a page fault per 4 KB page, which made a worker that
    builds 32 MB tensors spend five times longer faulting than filling them. Keeping freed
    memory (no mmap, no trimming) costs a worker's RSS staying at its peak. Not glibc: no-op.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


class _TaskRunner:
    """Runs a worker's tasks: on the calling thread, in order, until asked for more than one
    thread; from then on through a local queue served by that many threads.

    Threads are started as the count grows; when it shrinks, surplus threads exit after their
    current task (or, if idle, when they pick up the wake-up put in the queue for them).
    """

    _STOP, _SHRINK = object(), object()  # queue sentinels: leave now; leave if surplus

    def __init__(self, handler: Handler, output: _Output) -> None:
        self._handler = handler
        self._output = output
        self._queue: queue.SimpleQueue[tuple[int, Any] | object] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards _wanted and _serving
        self._wanted = 1
        self._serving = 0  # threads started and not yet leaving
        self._stopping = False

    def set_threads(self, n: int) -> None:
        """Run up to ``n`` tasks at once (``n > 1`` moves tasks to threads for good)."""
        if n <= 1 and not self._threads:
            return  # still running tasks inline, as every worker does by default
        with self._lock:
            self._wanted = max(1, n)
            surplus, missing = self._serving - self._wanted, self._wanted - self._serving
            self._serving += max(0, missing)
        for _ in range(surplus):
            self._queue.put(self._SHRINK)
        self._threads = [t for t in self._threads if t.is_alive()]
        for _ in range(missing):
            thread = threading.Thread(target=self._serve, name="torchpipe-task", daemon=True)
            thread.start()
            self._threads.append(thread)

    def run(self, batch: list[tuple[int, Any]]) -> None:
        """Run the tasks of one message, or queue them for the threads."""
        if not self._threads:
            for seq, payload in batch:
                self._output.run(self._handler, seq, payload)
            return
        for task in batch:
            self._queue.put(task)

    def stop(self, timeout: float) -> None:
        """Tell the threads to leave (queued tasks are dropped) and wait up to ``timeout`` s."""
        self._stopping = True
        for _ in self._threads:
            self._queue.put(self._STOP)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        try:
            while True:
                task = self._queue.get()
                if task is self._STOP or self._stopping:
                    return
                if task is not self._SHRINK:
                    seq, payload = cast("tuple[int, Any]", task)
                    self._output.run(self._handler, seq, payload)
                if self._leave_if_surplus():
                    return
        except ChannelClosed:
            return  # the main thread sees the channel close too, and stops the others
        except BaseException:  # noqa: BLE001 - end the worker as an error on its main thread would
            traceback.print_exc()
            os._exit(1)

    def _leave_if_surplus(self) -> bool:
        with self._lock:
            if self._serving <= self._wanted:
                return False
            self._serving -= 1
            return True


class _Output:
    """Where a worker's results go: the first of its rings with room, a new ring, or a one-off
    segment.

    The main process holds ring records while its tensors view them (a prefetch buffer, the
    batch in use), so a ring can be full for a while. A record that finds no room within 2 ms
    takes a one-off segment (freed when the main process is done with it), unless no ring could
    ever hold it or records steadily find no room (a quarter of the last 16): then the worker adds
    a ring for two such records (up to its limit in all, ``MAX_RING_BYTES`` unless a RAM budget
    says less), so the steady state reuses
    mapped, already-faulted memory while a passing peak (a consumer that held more batches for a
    while) leaves no memory behind. A ring's pages stay faulted in (resident) once written.

    Safe to call from several threads: one lock is held from reserving room to sending the
    message (the main process returns ring records in the order they were sent), and around
    every send. The handler and ``codec.encode`` run outside it.
    """

    def __init__(self, channel: Channel, capacity: int, limit: int = MAX_RING_BYTES) -> None:
        self.channel = channel
        self._limit = limit
        self.rings: list[ShmRing] = []
        self._lock = threading.Lock()
        self._closed = False
        self._misses: collections.deque[bool] = collections.deque(maxlen=_MISS_WINDOW)
        with self._lock:
            self._add_ring(capacity)

    def _add_ring(self, capacity: int) -> None:
        ring = ShmRing.create(capacity)
        self.rings.append(ring)
        self.channel.send(("ring_added", len(self.rings) - 1), [ring.fd])

    def close(self, timeout: float = _JOIN_S) -> None:
        """Close the rings; a task thread still running later finds the output closed.

        If a thread holds the lock past ``timeout`` s, the rings are left to the process's exit.
        """
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            self._closed = True
            for ring in self.rings:
                ring.close()
        finally:
            self._lock.release()

    def run(self, handler: Handler, seq: int, payload: Any) -> None:
        """Run one task and send its result or error (``ChannelClosed`` if the main process is gone)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        with COUNTS.tally() as counts:
            try:
                encoded = codec.encode(handler(seq, payload))
            except Exception as e:  # noqa: BLE001 - sent to the main process, raised there
                packed = pack_exception(e)
                with self._lock:
                    self._send(("error", seq, packed, *_cost(wall, cpu, counts)))
                return
        with self._lock:
            self._write(seq, encoded, _cost(wall, cpu, counts))

    def _write(self, seq: int, encoded: codec.EncodedRecord, cost: tuple[float, float, float, Tally | None]) -> None:
        if self._closed:  # the worker is stopping: its rings are gone
            raise ChannelClosed("the worker is stopping")
        nbytes = encoded.nbytes
        placed = self._reserve(nbytes)
        if placed is None:
            segment = OneOffSegment.create(nbytes)
            try:
                encoded.write_into(segment.buffer)
                self._send(("segment", seq, nbytes, *cost), [segment.fd])
            finally:
                segment.close()
            return
        index, reservation = placed
        encoded.write_into(reservation.buffer)
        offset, nbytes = self.rings[index].commit(reservation)
        self._send(("ring", seq, index, offset, nbytes, *cost))

    def _send(self, message: tuple, fds: list[int] | tuple[int, ...] = ()) -> None:
        if self._closed:  # the worker is stopping: nobody reads the result
            raise ChannelClosed("the worker is stopping")
        self.channel.send(message, fds)

    def _reserve(self, nbytes: int) -> tuple[int, Reservation] | None:
        """Room for a record of ``nbytes`` in a ring, waiting a moment for one to free; None: a
        one-off segment takes it. A ring is added for a record no ring can hold, and where records
        steadily find no room (a quarter of the last ones), not for a passing peak."""
        placed = self._in_a_ring(nbytes, _RING_GRACE_S)
        if placed is None and (not any(ring.fits(nbytes) for ring in self.rings) or sum(self._misses) >= _GROW_AFTER):
            capacity = max(_MIN_RING_BYTES, _RESULTS_PER_RING * nbytes)
            if sum(r.capacity for r in self.rings) + capacity <= self._limit:
                self._add_ring(capacity)
                self._misses.clear()
                placed = self._in_a_ring(nbytes, 0.0)
        self._misses.append(placed is None)
        return placed

    def _in_a_ring(self, nbytes: int, wait: float) -> tuple[int, Reservation] | None:
        for index, ring in enumerate(self.rings):
            reservation = ring.reserve(nbytes, timeout=wait) if ring.fits(nbytes) else None
            if reservation is not None:
                return index, reservation
        return None


def _cost(wall_start: float, cpu_start: float, counts: Tally) -> tuple[float, float, float, Tally | None]:
    """``(start, wall seconds, CPU seconds, counts)`` of a task, always a message's last four
    fields: the start (``perf_counter``, one clock for all processes) places it in a trace; the
    counts are what the task counted (None: nothing, the usual case)."""
    return wall_start, time.perf_counter() - wall_start, time.thread_time() - cpu_start, counts or None


def pack_exception(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    """An exception as (pickle or None, type name, message, traceback text), for another process."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
        data = None
    return data, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text


def unpack_exception(packed: tuple[bytes | None, str, str, str], pid: int) -> BaseException:
    """Rebuild an exception from :func:`pack_exception`, with the worker's traceback as a note.

    The original type is kept when it can be unpickled here; otherwise a RuntimeError names it.
    """
    data, type_name, message, text = packed
    exc: BaseException | None = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:  # noqa: BLE001 - fall back to the text below
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{type_name}: {message} (the exception could not be sent from the worker)")
    add_note(exc, f"Traceback from worker process {pid}:\n{text.rstrip()}")
    return exc

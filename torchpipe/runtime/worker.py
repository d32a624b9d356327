"""The loop a worker process runs: take a task, run the handler, write the result to shared memory.

Protocol on the worker's channel (see ``docs/process_pool.md``)::

    worker -> main  ("ring_added", index)                + a ring's fd (its first, and more later)
    main -> worker  ("tasks", [(seq, payload), ...])     run in order
    worker -> main  ("ring", seq, index, offset, nbytes, wall_s, cpu_s)   result encoded in ring ``index``
                    ("segment", seq, nbytes, wall_s, cpu_s)              + fd: a result too large for the rings
                    ("error", seq, packed_exception, wall_s, cpu_s)

``wall_s`` and ``cpu_s`` are what the task cost the worker (the call and writing its result):
the autotuner's measure of the stage.
    main -> worker  ("stop",)                            finish and exit
"""

from __future__ import annotations

import ctypes
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from torchpipe.errors import add_note
from torchpipe.runtime import codec
from torchpipe.runtime.channel import Channel, ChannelClosed
from torchpipe.runtime.shm_ring import OneOffSegment, Reservation, ShmRing

_POLL_S = 0.5
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters
_RING_WAIT_S = 0.02
MAX_RING_BYTES = 512 << 20
"""A worker's rings together hold at most this; results beyond go to one-off segments."""
_MIN_RING_BYTES = 32 << 20
_RESULTS_PER_RING = 4
_RING_GRACE_S = 0.002  # a ring freed this soon is worth waiting for rather than adding one

Handler = Callable[[int, Any], Any]


def run_worker(channel: Channel, worker_id: int, handler: Handler, ring_capacity: int) -> None:
    """Serve tasks until told to stop, the channel closes, or the parent process is gone.

    Args:
        worker_id: the worker's slot, 0..size-1 (a replacement gets its predecessor's).
        handler: ``handler(seq, payload)`` per task; if it has ``start_worker(worker_id)``,
            that runs first.
    """
    torch.set_num_threads(1)  # one worker, one core; the pool provides the parallelism
    keep_freed_memory()
    start = getattr(handler, "start_worker", None)
    if start is not None:
        start(worker_id)  # per-worker setup (torch's worker seeding, worker_init_fn, ...)
    parent = os.getppid()
    output = _Output(channel, ring_capacity)
    try:
        while os.getppid() == parent:
            if not channel.poll(_POLL_S):
                continue
            message, _ = channel.recv()
            if message[0] != "tasks":
                return
            for seq, payload in message[1]:
                output.run(handler, seq, payload)
    except ChannelClosed:
        return
    finally:
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


class _Output:
    """Where a worker's results go: the first of its rings with room, a new ring, or a one-off
    segment.

    The main process holds ring records while its tensors view them (a prefetch buffer, the
    batch in use), so a ring can be full for a while. Rather than wait, the worker adds a ring
    (up to ``MAX_RING_BYTES`` in all), so the steady state reuses mapped, already-faulted memory;
    past that cap, a result that finds no room within 20 ms takes a one-off segment.
    """

    def __init__(self, channel: Channel, capacity: int) -> None:
        self.channel = channel
        self.rings: list[ShmRing] = []
        self._add_ring(capacity)

    def _add_ring(self, capacity: int) -> None:
        ring = ShmRing.create(capacity)
        self.rings.append(ring)
        self.channel.send(("ring_added", len(self.rings) - 1), [ring.fd])

    def close(self) -> None:
        for ring in self.rings:
            ring.close()

    def run(self, handler: Handler, seq: int, payload: Any) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            encoded = codec.encode(handler(seq, payload))
        except Exception as e:  # noqa: BLE001 - sent to the main process, raised there
            self.channel.send(("error", seq, pack_exception(e), *_cost(wall, cpu)))
            return
        nbytes = encoded.nbytes
        placed = self._reserve(nbytes)
        if placed is None:
            segment = OneOffSegment.create(nbytes)
            try:
                encoded.write_into(segment.buffer)
                self.channel.send(("segment", seq, nbytes, *_cost(wall, cpu)), [segment.fd])
            finally:
                segment.close()
            return
        index, reservation = placed
        encoded.write_into(reservation.buffer)
        offset, nbytes = self.rings[index].commit(reservation)
        self.channel.send(("ring", seq, index, offset, nbytes, *_cost(wall, cpu)))

    def _reserve(self, nbytes: int) -> tuple[int, Reservation] | None:
        for wait in (_RING_GRACE_S, None, _RING_WAIT_S):
            if wait is None:  # every ring is full or too small: add one, if the cap allows
                capacity = max(_MIN_RING_BYTES, _RESULTS_PER_RING * nbytes)
                if sum(r.capacity for r in self.rings) + capacity > MAX_RING_BYTES:
                    continue
                self._add_ring(capacity)
            for index, ring in enumerate(self.rings):
                reservation = ring.reserve(nbytes, timeout=wait or 0) if ring.fits(nbytes) else None
                if reservation is not None:
                    return index, reservation
        return None


def _cost(wall_start: float, cpu_start: float) -> tuple[float, float]:
    return time.perf_counter() - wall_start, time.thread_time() - cpu_start


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

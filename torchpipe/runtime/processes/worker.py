"""The loop a worker process runs: take a task, run the handler, write the result to shared memory.

Protocol on the worker's channel (see ``docs/process_pool.md``)::

    worker -> main  ("ring_added", index, replaces)      + a ring's fd (replaces: the older rings
                                                         take no more records)
    main -> worker  ("tasks", [(seq, payload), ...])     run in order (or on the worker's threads)
                    ("threads", n)                       run up to n tasks at once, on threads
                    ("slots", n)                         the results main may hold at once (ring slots)
                    ("stop",)                            stop the threads and exit (no task in flight)
                    ("mapped", [seq, ...])               these segments reached main: close them
                    ("resend", seq[, index, offset, nbytes])  a segment's (or ring's) fd was lost:
                                                         send the result in the channel
                    ("descriptors", allowed[, lost_ring])  main is short of descriptors (or no more)
                    ("pages", keep)                      slots keep their pages once released, or
                                                         (a memory budget binds) give them back
    worker -> main  ("ring", seq, index, offset, nbytes, *cost)   result encoded in ring ``index``
                    ("segment", seq, nbytes, *cost)              + fd: a result too large for the rings
                    ("bytes", seq, record, *cost)                the result, where main is short of fds
                    ("resent", seq, record)                      what "resend" asked for
                    ("error", seq, packed_exception, *cost)

``cost`` is ``(start, wall_s, cpu_s, delay_s, counts)``: when the task started, what it cost the
worker (the call and writing its result; CPU time of the thread that ran it and the time it waited
for a core: the autotuner's measure of the stage), and what it counted
(:mod:`~torchpipe.runtime.counts`; None when nothing).

Until a worker is sent ``("threads", n)`` with ``n > 1`` it runs tasks on its main thread, in
order. From then on its main thread only receives messages and its tasks go to a local queue
served by ``n`` threads, so the handler is called concurrently and must be thread-safe.

Where results go (a ring of slots sized at the first result, or one-off segments) is
:mod:`~torchpipe.runtime.processes.output`'s.
"""

from __future__ import annotations

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
from torchpipe.runtime.heap import keep_freed_memory, return_freed_memory
from torchpipe.runtime.processes.channel import Channel, ChannelClosed
from torchpipe.runtime.processes.output import IDLE_S, MAX_RING_BYTES, Output, pack_exception

__all__ = [
    "DEFAULT_SLOTS",
    "MAX_RING_BYTES",
    "pack_exception",
    "run_worker",
    "unpack_exception",
]

_POLL_S = 0.5
_RELEASE_POLL_S = 0.02  # under a budget: a slot released gives its pages back this soon
DEFAULT_SLOTS = 5
"""A worker's ring slots until the pool says: 4 tasks in flight and the one the consumer holds."""
_JOIN_S = 2.0  # how long a stopping worker waits for its task threads

Handler = Callable[[int, Any], Any]


def run_worker(
    channel: Channel,
    worker_id: int,
    handler: Handler,
    ring_limit: int = MAX_RING_BYTES,
    keep_freed: bool = True,
) -> None:
    """Serve tasks until told to stop, the channel closes, or the parent process is gone.

    Args:
        worker_id: the worker's slot, 0..size-1 (a replacement gets its predecessor's).
        ring_limit: the most the worker's ring holds (of the slots the pool asks for with
            ``("slots", n)``, :data:`DEFAULT_SLOTS` until then).
        keep_freed: keep freed memory for reuse (:func:`keep_freed_memory`) rather than return it.
        handler: ``handler(seq, payload)`` per task; if it has ``start_worker(worker_id)``,
            that runs first, and if it has ``queued(seq, payload)``, that is called on the
            worker's main thread as each task arrives, in order, before any thread runs it.
            After a ``("threads", n)`` message with ``n > 1`` it is called from up to ``n``
            threads at once, so it must then be thread-safe.
    """
    _set_up(handler, worker_id, keep_freed)
    parent = os.getppid()
    output = Output(channel, DEFAULT_SLOTS, ring_limit)
    tasks = _TaskRunner(handler, output)
    idle = _Idle(output)
    try:
        _serve_messages(channel, parent, tasks, output, idle, keep_freed)
    except ChannelClosed:
        return
    finally:
        tasks.stop(_JOIN_S)
        output.close()


def _set_up(handler: Handler, worker_id: int, keep_freed: bool) -> None:
    """The worker's own setup, before it serves: one intra-op thread, freed memory kept (where
    ``keep_freed``), and the handler's ``start_worker(worker_id)`` where it has one."""
    torch.set_num_threads(1)  # one worker, one core; the pool provides the parallelism
    if keep_freed:
        keep_freed_memory()
    start = getattr(handler, "start_worker", None)
    if start is not None:
        start(worker_id)  # per-worker setup (torch's worker seeding, worker_init_fn, ...)


def _serve_messages(
    channel: Channel, parent: int, tasks: _TaskRunner, output: Output, idle: _Idle, keep_freed: bool
) -> None:
    """The worker's loop: run the tasks it is sent and act on the other messages until told to
    stop or the ``parent`` process is gone; between messages, give pages back (:class:`_Idle`,
    slots released under a budget)."""
    while os.getppid() == parent:
        if not channel.poll(_RELEASE_POLL_S if output.releasing else _POLL_S):
            idle.check()
            output.give_back_released()
            continue
        idle.busy()
        message, _ = channel.recv()
        if message[0] == "tasks":
            tasks.run(message[1])
        elif message[0] == "stop":
            return
        else:
            _configure(message, tasks, output, keep_freed)


def _configure(message: tuple, tasks: _TaskRunner, output: Output, keep_freed: bool) -> None:
    """Act on a message from the main process that is not a task (``keep_freed``: the worker's
    own choice, where no memory budget binds)."""
    kind, *args = message
    if kind == "pages":  # a memory budget binds (False), or no longer does
        output.set_slot_pages(*args)
        keep_freed_memory() if args[0] and keep_freed else return_freed_memory()
    elif kind == "threads":
        tasks.set_threads(*args)
    elif kind == "slots":
        output.set_slots(*args)
    elif kind == "mapped":
        output.confirmed(*args)
    elif kind == "resend":
        output.resend(*args)
    elif kind == "descriptors":
        output.set_descriptors(*args)
    else:
        raise ValueError(f"a worker got a message it does not know: {kind!r}")


class _Idle:
    """When a worker has received no task and written no result for :data:`IDLE_S`, its free
    ring slots give their pages back, once each idle spell."""

    def __init__(self, output: Output) -> None:
        self._output = output
        self._since = time.monotonic()
        self._written = output.written
        self._given = False

    def busy(self) -> None:
        self._since, self._given = time.monotonic(), False

    def check(self) -> None:
        if self._output.written != self._written:  # a task thread wrote a result since
            self._written = self._output.written
            self.busy()
        elif not self._given and time.monotonic() - self._since >= IDLE_S:
            self._given = True
            self._output.give_back_idle()


class _TaskRunner:
    """Runs a worker's tasks: on the calling thread, in order, until asked for more than one
    thread; from then on through a local queue served by that many threads.

    Threads are started as the count grows; when it shrinks, surplus threads exit after their
    current task (or, if idle, when they pick up the wake-up put in the queue for them).
    """

    _STOP, _SHRINK = object(), object()  # queue sentinels: leave now; leave if surplus

    def __init__(self, handler: Handler, output: Output) -> None:
        self._handler = handler
        self._queued: Callable[[int, Any], None] | None = getattr(handler, "queued", None)
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
        if self._queued is not None:
            for seq, payload in batch:
                self._queued(seq, payload)
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
        exc = RuntimeError(
            f"{type_name}: {message} (the exception could not be sent from the worker)"
        )
    add_note(exc, f"Traceback from worker process {pid}:\n{text.rstrip()}")
    return exc

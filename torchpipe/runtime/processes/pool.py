"""Worker processes fed by central dispatch, returning results through shared-memory rings.

The main process numbers tasks and hands each to the live worker with the fewest in flight (at most
``per_worker``, or the tasks a worker runs at once on its threads if more), so the pool can grow
and shrink while it runs and a dead worker's tasks can go to its replacement. Each worker writes
results into its own ring (:mod:`torchpipe.runtime.processes.shm_ring`), of as many slots as
results the main process may hold from it (:mod:`torchpipe.runtime.processes.output`); only
``(seq, offset, nbytes)`` crosses the socket. The main process decodes each result as soon as its
message arrives; its tensors and arrays view the ring record (no copy) and the record is reused
once the last of them is freed, or, given an ``allocate`` hook (pinned memory), they are copied
there and the record is reused at once.
See ``docs/process_pool.md``.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from torchpipe.errors import WorkerError
from torchpipe.runtime import codec
from torchpipe.runtime.counts import COUNTS
from torchpipe.runtime.executor import Result
from torchpipe.runtime.processes.channel import Channel, ChannelClosed, DescriptorsLost
from torchpipe.runtime.processes.descriptors import (
    DescriptorBudget,
    is_open_files_error,
    open_files_error,
)
from torchpipe.runtime.processes.loans import RingLoans
from torchpipe.runtime.processes.memfd import OneOffSegment, memfd_supported
from torchpipe.runtime.processes.output import MAX_RING_BYTES
from torchpipe.runtime.processes.shm_ring import ShmRing
from torchpipe.runtime.processes.worker import run_worker, unpack_exception
from torchpipe.runtime.processes.zygote import Zygote, ZygoteGone, describe_exit
from torchpipe.runtime.routing import MAX_TASK_FAILURES, Task
from torchpipe.runtime.timing import CallTiming
from torchpipe.runtime.worker_pool import WorkerPool

PER_WORKER = 4
"""Tasks in flight per worker by default (more when each worker runs more tasks at once on threads)."""


class _Worker:
    __slots__ = ("id", "slot", "pid", "channel", "zygote", "rings", "tasks", "retiring", "mapped")
    ready = True  # takes tasks as soon as it is forked (the router asks)

    def __init__(
        self, worker_id: int, slot: int, pid: int, channel: Channel, zygote: Zygote
    ) -> None:
        self.id = worker_id
        # 0..size-1: what the worker's code sees as its id; replacements inherit it
        self.slot = slot
        self.pid = pid
        self.channel = channel
        self.zygote = zygote  # the one that forked it, which reaps it
        self.rings: list[
            RingLoans | None
        ] = []  # the worker's rings, by index (None: its fd was lost)
        self.tasks: dict[int, Task] = {}  # in flight (or sent again without a descriptor), by seq
        self.retiring = False
        self.mapped: list[int] = []  # results whose segments were mapped here, to tell the worker

    def describe(self) -> str:
        return f"worker process {self.pid}"

    def close(self) -> None:
        self.channel.close()
        for loans in self.rings:
            if loans is not None:
                loans.close()  # tensors still viewing a ring keep its mapping alive


class ProcessPool(WorkerPool[_Worker]):
    """A resizable pool of worker processes forked from a zygote.

    Create it before the pipeline starts threads: the constructor forks the zygote; ``start``
    (or ``resize``) forks the workers from it. With ``fork_now=False`` the zygote is forked by
    the first ``resize`` to workers instead (for a stage that will likely not use its pool; one
    that forks it late forks a process that may run threads, as torch's DataLoader always does).

    Args:
        handler: ``handler(seq, payload) -> value``, run in the workers; it is inherited
            through fork, never pickled.
        size: number of workers.
        name: the stage name, used in errors.
        restart: replace a worker that dies and re-dispatch its tasks; if False, raise
            :class:`WorkerError` instead.
        per_worker: tasks in flight per worker (more if ``threads`` is larger); a worker's ring
            has a slot for each, and one for the result the consumer holds (none with
            ``allocate``: a result is copied out as it arrives). :meth:`set_per_worker` changes it.
        held: results of a worker the consumer holds besides those in flight, each a slot of
            its ring (default: 1, or 0 with ``allocate``).
        ring_limit: the most a worker's ring holds, its slots sized at its first result
            (``MAX_RING_BYTES``; less under a RAM budget: results beyond travel in one-off
            segments, freed once used).
        keep_freed: workers keep the memory they free for reuse (no page faults for the next
            large result; their memory stays at its peak); False under a RAM budget.
        allocate: where decoded tensors land (``allocate(shape, dtype)``), e.g. pinned memory.
        timing: where the workers' task costs are added up (each result message carries them).
        threads: how many tasks each worker runs at once, on threads of its own (for tasks
            that wait on I/O). With more than 1 the handler is called concurrently from several
            threads of a worker, so it must be thread-safe; with 1 tasks run in order on the
            worker's main thread.

        fork_now: fork the zygote now (else at the first worker).

    Raises:
        ValueError: if ``threads`` or ``per_worker`` is not an int >= 1, or ``held`` not an int >= 0.
    """

    def __init__(
        self,
        handler: Callable[[int, Any], Any],
        size: int,
        name: str,
        *,
        restart: bool = True,
        ring_limit: int = MAX_RING_BYTES,
        keep_freed: bool = True,
        allocate: Callable[..., Any] | None = None,
        timing: CallTiming | None = None,
        threads: int = 1,
        fork_now: bool = True,
        per_worker: int = PER_WORKER,
        held: int | None = None,
    ) -> None:
        super().__init__(name, size, restart, timing)
        self._threads = self._checked(threads, "threads per worker")
        self._tasks_per_worker = self._checked(per_worker, "tasks in flight per worker")
        self._allocate = allocate
        if held is None:
            held = 0 if allocate is not None else 1
        self._held = self._checked(held, "results held", 0)
        self._worker_main = functools.partial(
            run_worker, handler=handler, ring_limit=ring_limit, keep_freed=keep_freed
        )
        self._zygote: Zygote | None = self._new_zygote() if fork_now else None
        self._next_id = 0
        self.descriptors = DescriptorBudget()  # whether workers may pass descriptors (open files)
        self._slot_pages = True  # whether the workers' slots keep their pages once released

    def fork_zygote(self) -> None:
        """Fork the zygote now where none runs (a pool made with ``fork_now=False`` forks it at
        its first worker): from a thread that runs the user's code alone at this moment, so
        that the zygote and its workers copy no lock another thread holds, and later workers can
        be started from any thread."""
        self._live_zygote()

    def start(self) -> None:
        """Spawn the workers (the zygote is already running). At size 0 (:meth:`resize`) the pool
        is parked: no workers, its zygote ready to fork them again."""
        self.resize(self._size)

    @property
    def threads(self) -> int:
        """How many tasks each worker runs at once."""
        return self._threads

    def set_threads(self, n: int) -> None:
        """Let each worker run ``n`` tasks at once, on threads of its own, from now on.

        Live workers are told at once; workers spawned later get ``n`` before any task. With
        ``n > 1`` the handler is called concurrently from several threads of a worker.

        Raises:
            ValueError: if ``n`` is not an int >= 1.
        """
        if self._checked(n, "threads per worker") == self._threads:
            return  # live workers have it; new ones get it when spawned
        slots = self._slots
        self._threads = n
        for worker in list(self._workers.values()):
            self._tell(worker, ("threads", n))
        self._slots_changed(slots)
        self._dispatch()

    @property
    def per_worker(self) -> int:
        """Tasks in flight per worker asked for (the pool keeps ``max(per_worker, threads)``)."""
        return self._tasks_per_worker

    def set_per_worker(self, n: int) -> None:
        """Keep up to ``n`` tasks in flight per worker from now on (a stage's buffer knob).

        Each worker's ring follows: at its next result it takes a ring of the new slot count
        (its old ring goes once the main process has given back its records).

        Raises:
            ValueError: if ``n`` is not an int >= 1.
        """
        slots = self._slots
        self._tasks_per_worker = self._checked(n, "tasks in flight per worker")
        self._slots_changed(slots)
        self._dispatch()

    def set_held(self, n: int) -> None:
        """Each worker's ring keeps ``n`` slots for results the consumer holds besides those in
        flight from now on (0: the consumer's are counted in flight; see ``held``). Each worker
        takes a ring of the new slot count at its next result.

        Raises:
            ValueError: if ``n`` is not an int >= 0.
        """
        slots = self._slots
        self._held = self._checked(n, "results held", 0)
        self._slots_changed(slots)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers.values() if not w.retiring]

    @property
    def process_ids(self) -> list[int]:
        """The workers' pids and the zygote's: the processes the pool holds memory in."""
        zygote = [self._zygote.pid] if self._zygote is not None else []
        return [w.pid for w in self._workers.values()] + zygote

    @property
    def zygote_pid(self) -> int | None:
        """The zygote's pid (None before it is forked or once released)."""
        return self._zygote.pid if self._zygote is not None else None

    @property
    def worker_rings(self) -> list[list[ShmRing]]:
        """Each worker's shared-memory rings as mapped here, retiring workers too, in the order
        the worker added them: a seam for tests."""
        return [[r.ring for r in w.rings if r is not None] for w in self._workers.values()]

    @property
    def ring_bytes(self) -> int:
        """The bytes of the workers' rings in use, as mapped here."""
        rings = [
            loans.ring for w in self._workers.values() for loans in w.rings if loans is not None
        ]
        return sum(ring.capacity for ring in rings if not ring.closed)

    @property
    def ring_residency(self) -> dict[int, int]:
        """Each worker's rings' resident bytes (their pages written and not given back), by pid:
        what its rings hold, where :attr:`ring_bytes` is what they may (a memory budget's count)."""
        return {
            w.pid: sum(
                loans.ring.resident_bytes()
                for loans in w.rings
                if loans is not None and not loans.ring.closed
            )
            for w in self._workers.values()
        }

    @property
    def slot_pages(self) -> bool:
        """Whether the workers' ring slots keep their pages once released (see :meth:`set_slot_pages`)."""
        return self._slot_pages

    def set_slot_pages(self, keep: bool) -> None:
        """Whether the workers' ring slots keep their pages once their result is released (True:
        no page faults when written again) or give them back, and the workers their freed heap
        (False: a memory budget binds; the rings then hold what is in flight, as torch's
        DataLoader holds its batches, and no slot more for results the consumer keeps)."""
        if keep != self._slot_pages:
            self._slot_pages = keep
            for worker in list(self._workers.values()):
                self._tell(worker, ("pages", keep))

    def release_zygote(self) -> bool:
        """Stop the zygote of a pool with no workers left (its copies of the pages this process
        rewrote since the fork are memory held for nothing); the next worker forks a new one.
        Whether it was stopped."""
        if self._workers or self._zygote is None:
            return False
        self._zygote.close()
        self._zygote = None
        return True

    # -- the pool's part of the contract (runtime/worker_pool.py) ----------------------------
    @property
    def _per_worker(self) -> int:
        return max(self._tasks_per_worker, self._threads)

    def _fill(self, slot: int) -> None:
        if not any(w.slot == slot and not w.retiring for w in self._workers.values()):
            self._spawn(slot)  # a retiring worker in the slot finishes its tasks first

    def _send_tasks(self, routed: Iterable[tuple[_Worker, Task]]) -> None:
        """Several tasks per message."""
        batches: dict[int, list[Task]] = {}
        for worker, task in routed:
            batches.setdefault(worker.id, []).append(task)
        for worker_id, batch in batches.items():
            if worker_id in self._workers:
                self._send_batch(self._workers[worker_id], batch)

    def _collect(self, timeout: float, results: list[Result]) -> None:
        channels = {w.channel.fileno(): w for w in self._workers.values()}
        ready, _, _ = select.select(list(channels), [], [], timeout)
        for fd in ready:
            worker = channels[fd]
            try:
                while worker.id in self._workers and worker.channel.poll(0):
                    self._receive(worker, results)
                if worker.mapped and worker.id in self._workers:  # not retired meanwhile
                    worker.channel.send(("mapped", worker.mapped))
                    worker.mapped = []
            except ChannelClosed:
                self._on_exit(worker)
        if self.descriptors.room_again(len(self._workers)):
            self._allow_descriptors(True)
        self._dispatch()

    def _release(self, worker: _Worker) -> None:
        try:
            worker.channel.send(("stop",))
        except ChannelClosed:
            pass
        worker.close()
        del self._workers[worker.id]

    def _close(self) -> None:
        """Kill the zygote and every worker."""
        if self._zygote is not None:
            self._zygote.close()
        for worker in self._workers.values():
            worker.close()

    def _queue_place(self) -> str:
        return "the process pool's queue"

    def _held_by(self, worker: _Worker) -> int:
        """The worker's ring records still lent out here (results not yet freed)."""
        return sum(loans.lent for loans in worker.rings if loans is not None)

    # -- internals --------------------------------------------------------------------------
    @property
    def _slots(self) -> int:
        """Results the main process may hold from a worker at once: its tasks in flight, and the
        ones the consumer holds (``held``)."""
        return self._per_worker + self._held

    def _slots_changed(self, before: int) -> None:
        if self._slots != before:
            for worker in list(self._workers.values()):
                self._tell(worker, ("slots", self._slots))

    def _checked(self, n: int, what: str, least: int = 1) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ValueError(f"{self.name}: {what} must be an int >= {least}, got {n!r}")
        return n

    def _tell(self, worker: _Worker, message: tuple) -> None:
        try:
            worker.channel.send(message)
        except ChannelClosed:
            pass  # it died: collect() sees its channel close and replaces it

    def _spawn(self, slot: int) -> None:
        worker_id = self._next_id
        self._next_id += 1
        try:
            pid, channel = self._fork_worker(slot)
        except OSError as e:
            if is_open_files_error(e):
                raise open_files_error(self.name, "start a worker process") from e
            raise
        assert self._zygote is not None  # it forked the worker
        worker = _Worker(worker_id, slot, pid, channel, self._zygote)
        self._workers[worker_id] = worker
        # before any task: its first result sizes its ring
        self._tell(worker, ("slots", self._slots))
        if not self._slot_pages:
            self._tell(worker, ("pages", False))
        if self.descriptors.short:
            worker.channel.descriptors = False
            self._tell(worker, ("descriptors", False, None))
        if self._threads > 1:  # before any task; with 1 the worker runs tasks inline already
            self._tell(worker, ("threads", self._threads))

    def _fork_worker(self, slot: int) -> tuple[int, Channel]:
        try:
            return self._live_zygote().spawn(slot)
        except ZygoteGone:  # killed, but not yet reaped when alive() looked
            self._replace_zygote()
            return self._live_zygote().spawn(slot)

    def _replace_zygote(self) -> None:
        """Fork a zygote where there is none yet (``fork_now=False``) or someone killed it (its
        workers died with it: it is reaped first). The main process may run threads by now;
        forking it is what torch's DataLoader always does."""
        if self._zygote is not None:
            self._zygote.close()
        self._zygote = self._new_zygote()

    def _new_zygote(self) -> Zygote:
        try:
            return Zygote(self._worker_main, self.name)
        except OSError as e:
            if is_open_files_error(e):
                raise open_files_error(self.name, "start its zygote process") from e
            raise

    def _live_zygote(self) -> Zygote:
        """The zygote, forked now where there is none or it was killed."""
        if self._zygote is None or not self._zygote.alive():
            self._replace_zygote()
        assert self._zygote is not None  # forked just now
        return self._zygote

    def _send_batch(self, worker: _Worker, batch: list[Task]) -> None:
        worker.tasks.update((task.seq, task) for task in batch)
        try:
            worker.channel.send(("tasks", [(task.seq, task.payload) for task in batch]))
        except ChannelClosed:
            self._on_exit(worker)
        except (pickle.PicklingError, TypeError, AttributeError):
            again = []
            for task in batch:  # find the culprits; queue the others again
                del worker.tasks[task.seq]
                try:
                    pickle.dumps(task.payload, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as e:  # noqa: BLE001 - reported as this element's error
                    self._unsent.append(
                        (task.seq, None, _unpicklable_input(self.name, task.seq, e))
                    )
                else:
                    again.append(task)
            self._router.requeue(again)

    def _receive(self, worker: _Worker, results: list[Result]) -> None:
        """Handle the worker's next message, one that came without its descriptor too."""
        try:
            message, fds = worker.channel.recv()
        except DescriptorsLost as e:
            if e.message is None:  # its body rode in the lost descriptor
                raise open_files_error(
                    self.name, f"receive a message from worker {worker.pid}"
                ) from e
            message, fds = e.message, []
            self.descriptors.ran_short()
            self._allow_descriptors(
                False, worker, message[1] if message[0] == "ring_added" else None
            )
        self._handle(worker, message, fds, results)

    def _handle(
        self, worker: _Worker, message: tuple, fds: list[int], results: list[Result]
    ) -> None:
        kind = message[0]
        if kind == "ring_added":
            if message[2]:  # it replaces the worker's rings: each goes once its records are back
                for loans in worker.rings:
                    if loans is not None:
                        loans.close()
            worker.rings.append(RingLoans(ShmRing.attach(fds[0])) if fds else None)
            return
        seq = message[1]
        if kind == "resent":  # its cost was counted when it first came, without its descriptor
            worker.tasks.pop(seq, None)
            results.append((seq, *self._result(worker, message, fds)))
            self._retire_if_idle(worker)
            return
        start, wall_s, cpu_s, delay_s, counts = message[-5:]
        where = f"worker {worker.slot} (pid {worker.pid})"
        self.timing.add(wall_s, cpu_s, start=start, where=where, pid=worker.pid, delay_s=delay_s)
        COUNTS.add_tally(counts)
        self._router.done(seq)
        if self._unreadable(worker, message, fds):
            self._tell(
                worker, ("resend", seq, *message[2:5]) if kind == "ring" else ("resend", seq)
            )
            return  # the task stays the worker's until the result comes again ("resent")
        worker.tasks.pop(seq, None)
        results.append((seq, *self._result(worker, message, fds)))
        self._retire_if_idle(worker)

    @staticmethod
    def _unreadable(worker: _Worker, message: tuple, fds: list[int]) -> bool:
        """Whether a result's memory did not reach this process: its segment's descriptor, or
        its ring's, was lost."""
        return (message[0] == "segment" and not fds) or (
            message[0] == "ring" and worker.rings[message[2]] is None
        )

    def _result(
        self, worker: _Worker, message: tuple, fds: list[int]
    ) -> tuple[Any, BaseException | None]:
        kind = message[0]
        if kind == "ring":
            loans = worker.rings[message[2]]
            assert loans is not None  # _unreadable() said so
            return self._decode_record(loans, message[3], message[4]), None
        if kind == "segment":
            worker.mapped.append(message[1])
            return self._decode_segment(fds[0], message[2]), None
        if kind in (
            "bytes",
            "resent",
        ):  # sent in the channel: the main process was short of descriptors
            return codec.decode(message[2], allocate=self._allocate), None
        return None, unpack_exception(message[2], worker.pid)

    def _allow_descriptors(
        self, allowed: bool, lost_by: _Worker | None = None, lost_ring: int | None = None
    ) -> None:
        """Tell every worker whether it may pass descriptors (``lost_by``: the one whose ring
        ``lost_ring`` did not arrive); large messages to them go in chunks meanwhile."""
        for worker in list(self._workers.values()):
            worker.channel.descriptors = allowed
            self._tell(worker, ("descriptors", allowed, lost_ring if worker is lost_by else None))

    def _decode_record(self, ring: RingLoans, offset: int, nbytes: int) -> Any:
        """The result in a ring record: tensors view the record, or are copied to ``allocate``."""
        base = ring.lend(offset, nbytes)
        if self._allocate is None:
            return codec.decode_view(base)
        return codec.decode(base, allocate=self._allocate)  # a copy: the record goes back at once

    def _decode_segment(self, fd: int, nbytes: int) -> Any:
        segment = OneOffSegment.attach(fd, nbytes)
        if self._allocate is not None:
            try:
                return codec.decode(segment.buffer, allocate=self._allocate)
            finally:
                segment.close()
        base = np.frombuffer(segment.buffer, np.uint8)
        weakref.finalize(base, segment.close)
        return codec.decode_view(base)

    def _on_exit(self, worker: _Worker) -> None:
        """A worker's channel closed: it died. Re-dispatch its tasks, or raise."""
        # Asked of the zygote that forked it: where that one died too (and took the worker with
        # it), the answer is at once, not a second's wait on a replacement that never knew it.
        status = worker.zygote.exit_status(worker.pid, timeout=1.0)
        how = describe_exit(status) if status is not None else "exited"
        worker.close()
        del self._workers[worker.id]
        lost = sorted(worker.tasks.values(), key=lambda task: task.seq)
        if not self._restart:
            raise WorkerError(f"{self.name}: worker process {worker.pid} {how}", worker.pid, how)
        for task in lost:
            if self._router.failed(task.seq):
                raise WorkerError(
                    f"{self.name}: element {task.seq} killed {MAX_TASK_FAILURES} worker processes "
                    f"(the last, pid {worker.pid}, {how})",
                    worker.pid,
                    how,
                )
        self._router.requeue(lost)
        if not worker.retiring:
            self._spawn(worker.slot)


def _unpicklable_input(stage: str, seq: int, error: Exception) -> TypeError:
    exc = TypeError(
        f"{stage}: input element {seq} could not be pickled to send it to a worker process ({error}). "
        "Make the elements that reach this stage picklable (tensors, arrays, plain data), read them "
        "inside the stage (tp.from_dataset(...).map(...) runs dataset[i] in the worker), or use "
        "executor='thread'."
    )
    exc.__cause__ = error
    return exc


def process_executor_supported() -> bool:
    """Whether this platform can run the process executor (fork and memfd: Linux)."""
    return hasattr(os, "fork") and memfd_supported()

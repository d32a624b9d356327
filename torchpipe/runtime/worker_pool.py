"""The contract of a pool of workers fed by central dispatch, and what every such pool does alike.

Two pools run a stage's tasks on workers they start: the process pool
(:class:`~torchpipe.runtime.processes.pool.ProcessPool`, forked worker processes) and the Ray
actor pool (:class:`~torchpipe.runtime.ray.pool.RayActorPool`). Both are executors
(:class:`~torchpipe.runtime.executor.Executor`), and :class:`WorkerPool` writes once what they
share: the tasks are numbered by the caller and wait in one
:class:`~torchpipe.runtime.routing.TaskRouter` until a worker can take them; each worker has a
slot (``0..size-1``), so resizing starts workers in the empty slots below the size and retires
those above it once their tasks are done; results are collected in batches, and the CPU this
process spends on them is counted (:meth:`WorkerPool.message_seconds`). What a worker is, how
tasks reach it, how results come back and how a death is noticed is each pool's own.

A pool implements ``_per_worker``, ``_fill``, ``_send_tasks``, ``_collect``, ``_release``,
``_close`` and ``_queue_place``; the rest are hooks with a default.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Iterable
from typing import Any, Generic, Protocol, TypeVar

from torchpipe.runtime.executor import Result
from torchpipe.runtime.routing import Routable, Task, TaskRouter
from torchpipe.runtime.timing import CallTiming


class PoolWorker(Routable, Protocol):
    """What the pool reads of a worker: the router's fields, and how to name it in errors."""

    def describe(self) -> str:
        """The worker, for errors: ``worker process 1234``, ``Ray actor 0 (pid 1234 on ...)``."""


W = TypeVar("W", bound=PoolWorker)


class WorkerPool(abc.ABC, Generic[W]):
    """A resizable pool of workers that runs ``handler(seq, payload)`` tasks, dispatched centrally.

    Args:
        name: the stage's name, used in errors.
        size: the number of workers asked for.
        restart: replace a worker that dies and send its tasks again (False: raise
            :class:`~torchpipe.errors.WorkerError`).
        timing: where the calls' costs are added up.
    """

    _lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    """Held around every call of the consumer's (a pool another thread also uses sets a lock)."""

    def __init__(self, name: str, size: int, restart: bool, timing: CallTiming | None) -> None:
        self.name = name
        self.timing = timing if timing is not None else CallTiming()
        self._restart = restart
        self._size = size
        self._workers: dict[int, W] = {}  # by a key of the pool's (an id, a slot)
        self._router = TaskRouter()
        self._unsent: list[Result] = []  # results of tasks no worker ran (their input, say)
        self._main_cpu_s = 0.0  # this process's CPU in submit() and collect()
        self._received = 0  # results collected

    # -- the contract -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """How many tasks may be in flight at once."""
        return self._size * self._per_worker

    @property
    def size(self) -> int:
        """The number of workers asked for (retiring ones finish their tasks first)."""
        return self._size

    def submit(
        self, seq: int, payload: Any, slot: int | None = None, prefer: int | None = None
    ) -> None:
        """Queue task ``seq`` for the least busy ready worker, or for the worker in ``slot`` (in
        order: later tasks of the slot wait behind it). ``prefer`` names a slot whose worker should
        run it (it may hold state from earlier tasks, e.g. an open file): the task waits while that
        worker is busy, and goes to the least busy one only when the slot has none."""
        cpu = time.thread_time()
        with self._lock:
            self._touch()
            self._queue(Task(seq, payload, slot, prefer))
            self._dispatch()
        self._main_cpu_s += time.thread_time() - cpu

    def collect(self, timeout: float) -> list[Result]:
        """Results that arrived, as ``(seq, value, error)``; waits up to ``timeout`` s for one."""
        cpu = time.thread_time()
        try:
            with self._lock:
                self._touch()
                results, self._unsent = self._unsent, []
                self._collect(0 if results else timeout, results)
                self._received += len(results)
                return results
        finally:
            self._main_cpu_s += time.thread_time() - cpu

    def holds(self, seq: int) -> bool:
        """Whether task ``seq`` was submitted here and its result not yet collected."""
        return self._has_task(seq) or any(result[0] == seq for result in self._unsent)

    def where(self, seq: int) -> str:
        """Where task ``seq`` is, for errors: the worker running it, or the pool's queue."""
        worker = next((w for w in self._workers.values() if seq in w.tasks), None)
        return worker.describe() if worker is not None else self._queue_place()

    def resize(self, size: int) -> None:
        """Grow by starting workers in the empty slots below ``size``; shrink by retiring those in
        the slots from ``size`` up once their tasks are done.

        Raises:
            ValueError: if ``size`` is negative.
        """
        if size < 0:
            raise ValueError(f"{self.name}: pool size must be >= 0, got {size}")
        with self._lock:
            self._resize(size)

    def close(self) -> None:
        """Stop using every worker and drop the queued tasks; idempotent."""
        with self._lock:
            self._close()
            self._workers.clear()
            self._router.clear()

    def message_seconds(self) -> float | None:
        """This process's CPU time per result so far: sending the task, waiting, receiving and
        decoding the result (what a task costs here besides the work); None before 32 results."""
        return self._main_cpu_s / self._received if self._received >= 32 else None

    # -- what each pool implements ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def _per_worker(self) -> int:
        """The most tasks a worker may have in flight."""

    @abc.abstractmethod
    def _fill(self, slot: int) -> None:
        """Have a worker take tasks in ``slot`` (start one, or keep a retiring one)."""

    @abc.abstractmethod
    def _send_tasks(self, routed: Iterable[tuple[W, Task]]) -> None:
        """Send each routed task to its worker and count it in the worker's ``tasks``."""

    @abc.abstractmethod
    def _collect(self, timeout: float, results: list[Result]) -> None:
        """Add the results that arrived to ``results``, waiting up to ``timeout`` s for one."""

    @abc.abstractmethod
    def _release(self, worker: W) -> None:
        """Let go of ``worker``, a retiring one whose tasks are done: it leaves ``_workers``."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Stop using every worker (:meth:`close` then forgets them and the queued tasks)."""

    @abc.abstractmethod
    def _queue_place(self) -> str:
        """The pool's queue, for errors about a task that no worker runs yet."""

    # -- hooks ------------------------------------------------------------------------------
    def _touch(self) -> None:
        """The consumer calls (:meth:`submit`, :meth:`collect`)."""

    def _queue(self, task: Task) -> None:
        """Queue ``task`` until a worker takes it."""
        self._router.add(task)

    def _has_task(self, seq: int) -> bool:
        """Whether task ``seq`` is queued here or runs on a worker."""
        return self._router.holds(seq) or any(seq in w.tasks for w in self._workers.values())

    def _slot_of(self, prefer: int) -> int:
        """The slot of the worker a task that prefers slot ``prefer`` goes to."""
        return prefer

    def _held_by(self, worker: W) -> int:
        """How many of ``worker``'s results the consumer still holds, where they take its memory
        (a worker process's ring records): the router's tie-break (0: nothing kept there)."""
        return 0

    # -- what they do alike -----------------------------------------------------------------
    def _resize(self, size: int) -> None:
        self._size = size
        for slot in range(size):
            self._fill(slot)
        for worker in [w for w in self._workers.values() if w.slot >= size and not w.retiring]:
            worker.retiring = True
            self._retire_if_idle(worker)
        self._dispatch()

    def _dispatch(self) -> None:
        """Send queued tasks, in order, to workers with room (:class:`TaskRouter`'s rule)."""
        if self._router:
            workers = self._workers.values()
            routed = self._router.route(
                workers, self._per_worker, slot_of=self._slot_of, held=self._held_by
            )
            self._send_tasks(routed)

    def _retire_if_idle(self, worker: W) -> None:
        if worker.retiring and not worker.tasks:
            self._release(worker)

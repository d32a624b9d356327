"""A pool of Ray actors behind the runtime's Executor interface.

The dispatcher (``runtime/dispatch.py``) numbers a stage's tasks and puts results back in order
whatever runs them; :class:`RayActorPool` runs them on :class:`~torchpipe.runtime.ray.actors.
TaskServer` actors. Like the process pool it dispatches centrally: each task goes to the ready
actor with the fewest in flight (``tasks_per_actor`` at most), so the pool can grow and shrink
while it runs and a dead actor's tasks go to whichever actor is up. An actor is *ready* once it
has answered its installation (the handler loaded, its pid and node known); tasks wait in the
pool's queue until some actor is, so actors that the cluster cannot place yet hold nothing up.

Faults: a task whose actor died (a killed process, a lost node) fails with a Ray actor error;
the task is queued again (each result comes from one call: Ray's own task retries are off) and
the actor is installed again once Ray has restarted it (``max_restarts``), or replaced by a new
one if Ray gave up on it. An element whose calls killed three actors raises
:class:`~torchpipe.errors.WorkerError`, as does any death with ``restart=False``.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from typing import Any, Protocol, cast

import numpy as np

from torchpipe.errors import WorkerError
from torchpipe.runtime import codec
from torchpipe.runtime.codec.pickling import ALIGN
from torchpipe.runtime.executor import Result
from torchpipe.runtime.processes.worker import unpack_exception
from torchpipe.runtime.ray.actors import ERROR, IDLE, OK, STALE, connect, session, start_actor
from torchpipe.runtime.ray.stats import ActorStats, PoolStats
from torchpipe.runtime.routing import MAX_TASK_FAILURES, Task
from torchpipe.runtime.timing import CallTiming
from torchpipe.runtime.worker_pool import WorkerPool

_RETRY_S = 0.1  # an actor Ray is still restarting is asked again after this long
_FREE_CPUS_S = 2.0  # how long the cluster's free CPUs, as last read, stand
_GET_S = 10.0  # a result already in the object store; the bound is for a node lost in between
# an actor not started this long makes the pool take those of pools left unused this long
_RECLAIM_S = 0.5

_POOLS: weakref.WeakSet[RayActorPool] = weakref.WeakSet()


class ActorOptions(Protocol):
    """What a pool needs of its options (a ``tp.RayExecutor``, which makes the pool)."""

    @property
    def min_actors(self) -> int: ...
    @property
    def max_actors(self) -> int | None: ...
    @property
    def num_cpus(self) -> float: ...
    @property
    def address(self) -> str | None: ...
    @property
    def tasks_per_actor(self) -> int: ...

    def actor_options(self, restart: bool) -> dict[str, Any]:
        """Each actor's Ray ``.options(...)``."""


class _Actor:
    """One actor slot: the actor handle, whether it is installed, and its tasks in flight."""

    __slots__ = (
        "slot",
        "handle",
        "ready",
        "pid",
        "node",
        "node_id",
        "ping",
        "retry_at",
        "tasks",
        "retiring",
        "stats",
        "added_at",
    )

    def __init__(self, slot: int, handle: Any) -> None:
        self.slot = slot
        self.handle = handle
        self.ready = False
        self.pid: int | None = None
        self.node = "?"  # its node's address
        self.node_id = ""  # and Ray's id of it
        self.ping: Any = None  # the installation call in flight
        self.retry_at = 0.0  # when to install again, after Ray said it is restarting
        self.tasks: dict[int, Any] = {}  # seq -> the call's object reference
        self.retiring = False
        self.stats = ActorStats()
        self.added_at = time.monotonic()

    def describe(self) -> str:
        if self.pid is None:
            return f"Ray actor {self.slot} (starting)"
        return f"Ray actor {self.slot} (pid {self.pid} on {self.node})"


class RayActorPool(WorkerPool[_Actor]):
    """Runs ``handler(seq, payload)`` tasks on Ray actors; resizable, restarts dead actors.

    A task's ``slot`` is a preference here, as ``prefer`` is (an actor holds no order).

    Args:
        handler: the task, pickled once into the object store (cloudpickle: lambdas and
            closures travel; the modules they import must exist on the cluster's nodes).
        size: actors to start with.
        name: the stage's name, for errors.
        options: what each actor reserves and where it goes.
        restart: replace dead actors and send their tasks again; if False, raise
            :class:`WorkerError` instead.
        timing: where the calls' costs are added up.

    Raises:
        ImportError: if Ray is not installed.
        TypeError: if ``handler`` cannot be pickled for the actors.
    """

    _lock: threading.RLock  # another pool's thread may take this one's lapsed actors

    def __init__(
        self,
        handler: Any,
        size: int,
        name: str,
        options: ActorOptions,
        *,
        restart: bool = True,
        timing: CallTiming | None = None,
    ) -> None:
        super().__init__(name, 0, restart, timing)
        self._ray = connect(options.address)
        self._options = options
        self._key = (session(), repr(sorted(options.actor_options(restart).items())))
        self._token = uuid.uuid4().hex
        self._boxed = [self._put_handler(handler)]  # in a list: Ray does not resolve it per call
        self._threads = max(1, int(options.num_cpus))
        self._pings: dict[Any, _Actor] = {}  # installation call -> its actor
        self._running: dict[Any, tuple[_Actor, int]] = {}  # call reference -> (actor, seq)
        self._payloads: dict[int, Task] = {}  # every task held: queued or running
        self._free = (-1e9, 0)  # (when read, the actors that fitted then: held + free CPUs')
        self.stats = PoolStats()
        self._lock = threading.RLock()
        self._touched = time.monotonic()  # when the consumer last called
        # its actors were taken while it was not used: start them again when it is
        self._lapsed = False
        self._reclaimed_at = 0.0
        _POOLS.add(self)
        self.resize(size)

    def _put_handler(self, handler: Any) -> Any:
        try:
            return self._ray.put(handler)
        except Exception as e:
            raise TypeError(
                f"{self.name}: the stage's function could not be pickled to send it to Ray actors ({e}). "
                "Use a function defined at module level or a lambda whose captured values pickle."
            ) from e

    @property
    def capacity(self) -> int:
        """How many tasks may be in flight: a pool of no actors still takes one actor's."""
        return max(self._size, 1) * self._per_worker

    # -- what the iterator and the autotuner ask ------------------------------------------------
    def most_actors(self) -> int:
        """The most actors the stage may have: ``max_actors``, and no more than the cluster's free
        CPUs allow besides those it held when they were read (read at most every
        ``_FREE_CPUS_S``: actors started since are not counted twice), nor more than all its CPUs."""
        now = time.monotonic()
        per_actor = self._options.num_cpus
        if per_actor <= 0:
            fits = 1 << 16
        else:
            if now - self._free[0] > _FREE_CPUS_S:
                free = float(self._ray.available_resources().get("CPU", 0.0))
                total = float(self._ray.cluster_resources().get("CPU", 0.0))
                self._free = (
                    now,
                    min(len(self._workers) + int(free // per_actor), int(total // per_actor)),
                )
            fits = self._free[1]
        most = fits if self._options.max_actors is None else min(fits, self._options.max_actors)
        return max(most, self._options.min_actors)

    def report(self) -> dict[str, Any]:
        """Per-actor calls and times, and what moving results here cost (``it.stats()``)."""
        actors = {
            a.describe(): a.stats.as_dict()
            for a in sorted(self._workers.values(), key=lambda a: a.slot)
        }
        return self.stats.as_dict(actors)

    def actor_processes(self) -> list[tuple[Any, int | None, str]]:
        """``(actor handle, pid, Ray's node id)`` of every actor the pool runs (for fault tests)."""
        return [(a.handle, a.pid, a.node_id) for a in self._workers.values() if not a.retiring]

    def lapse_if_unused(self, unused_s: float) -> bool:
        """Give up every actor if the consumer has not called for ``unused_s`` seconds (a pass
        left unfinished and not closed): another pool needs the CPUs they hold. Calls already
        sent finish and are collected as ever; the pool starts actors again when used. Whether
        it gave them up."""
        if not self._lock.acquire(blocking=False):
            return False  # in use right now
        try:
            if self._lapsed or not self._workers or time.monotonic() - self._touched < unused_s:
                return False
            for actor in list(self._workers.values()):
                self._release(actor)
            self._lapsed = True
            return True
        finally:
            self._lock.release()

    # -- the pool's part of the contract (runtime/worker_pool.py) ------------------------------
    @property
    def _per_worker(self) -> int:
        return self._options.tasks_per_actor

    def _touch(self) -> None:
        self._touched = time.monotonic()
        if self._lapsed:  # used again after its actors were taken: start (or take) some
            self._lapsed = False
            self._resize(self._size)

    def _resize(self, size: int) -> None:
        self._touched = time.monotonic()
        super()._resize(size)

    def _fill(self, slot: int) -> None:
        actor = self._workers.get(slot)
        if actor is None:
            self._add(slot)
        elif actor.retiring:
            actor.retiring = False

    def _queue(self, task: Task) -> None:
        prefer = task.prefer if task.prefer is not None else task.slot
        task = task._replace(slot=None, prefer=prefer)  # a slot is a preference here
        self._payloads[task.seq] = task
        self._router.add(task)

    def _has_task(self, seq: int) -> bool:
        return seq in self._payloads  # also the calls of actors it gave up while unused

    def _queue_place(self) -> str:
        waiting = sum(not a.ready for a in self._workers.values())
        return f"the Ray pool's queue ({waiting} of {len(self._workers)} actors not started or restarting)"

    def _slot_of(self, prefer: int) -> int:
        return prefer % max(self._size, 1)

    def _close(self) -> None:
        """Idle actors stay warm for the next pool (``IDLE_S``)."""
        for actor in list(self._workers.values()):
            self._release(actor)
        self._pings.clear()
        self._running.clear()
        self._payloads.clear()

    # -- internals --------------------------------------------------------------------------
    def _reclaim(self) -> None:
        """Some actors of this pool could not start for a while (the cluster's CPUs are held):
        take the actors of pools nobody uses, and free the warm actors of other options."""
        now = time.monotonic()
        if now - self._reclaimed_at < _RECLAIM_S:
            return
        self._reclaimed_at = now
        for pool in running_pools():
            if pool is not self:
                pool.lapse_if_unused(_RECLAIM_S)
        for actor in [a for a in self._workers.values() if a.pid is None and not a.ready]:
            warm = IDLE.take(self._key)
            if warm is None:
                break
            self._pings.pop(actor.ping, None)
            self._ray.kill(actor.handle, no_restart=True)  # never started: nothing of it is lost
            actor.handle, actor.ping = warm, None
            self._install(actor)
        IDLE.clear(keep=self._key)

    def _starved(self) -> bool:
        """Whether an actor asked for has not started within ``_RECLAIM_S``."""
        now = time.monotonic()
        return any(a.pid is None and now - a.added_at > _RECLAIM_S for a in self._workers.values())

    def _add(self, slot: int) -> None:
        handle = IDLE.take(self._key)
        if handle is None:
            IDLE.clear(keep=self._key)  # warm actors of other options would hold the CPUs it needs
            handle = start_actor(self._options.actor_options(self._restart))
        actor = _Actor(slot, handle)
        self._workers[slot] = actor
        self._install(actor)

    def _install(self, actor: _Actor) -> None:
        actor.ready = False
        actor.ping = actor.handle.install.remote(
            self._token, self._boxed, actor.slot, self._threads
        )
        self._pings[actor.ping] = actor

    def _release(self, actor: _Actor) -> None:
        """Hand ``actor`` to the warm set if it is up, else kill it."""
        self._workers.pop(actor.slot, None)
        if actor.ping is not None:
            self._pings.pop(actor.ping, None)
        if actor.ready and self._ray.is_initialized():
            IDLE.give(self._key, actor.handle)
        elif self._ray.is_initialized():
            try:
                self._ray.kill(actor.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - dead already
                pass

    def _send_tasks(self, routed: Iterable[tuple[_Actor, Task]]) -> None:
        for actor, task in routed:
            ref = actor.handle.run.remote(self._token, task.seq, task.payload)
            actor.tasks[task.seq] = ref
            self._running[ref] = (actor, task.seq)

    def _collect(self, timeout: float, results: list[Result]) -> None:
        """Also: actors that answered their installation start taking tasks."""
        self._retry_installs()
        waiting = [*self._running, *self._pings]
        if not waiting:
            if timeout > 0:
                time.sleep(min(timeout, _RETRY_S))  # actors restarting: nothing to wait on yet
            return
        ready, _ = self._ray.wait(waiting, num_returns=1, timeout=timeout)
        if ready:
            more, _ = self._ray.wait(waiting, num_returns=len(waiting), timeout=0)
            ready = more or ready
        for ref in ready:
            if ref in self._pings:
                self._installed(self._pings.pop(ref), ref)
            elif ref in self._running:
                self._finished(ref, results)
        self._dispatch()
        if self._starved():
            self._reclaim()

    def _retry_installs(self) -> None:
        now = time.monotonic()
        for actor in self._workers.values():
            if not actor.ready and actor.ping is None and now >= actor.retry_at:
                self._install(actor)

    def _installed(self, actor: _Actor, ref: Any) -> None:
        """An installation answered: the actor takes tasks, or is restarting, or is gone."""
        actor.ping = None
        ray = self._ray
        try:
            answer = ray.get(ref, timeout=_GET_S)
        except ray.exceptions.ActorDiedError as e:  # Ray gave up on it: a new actor in its slot
            self._actor_died(actor, e)
            return
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.GetTimeoutError,
        ):  # restarting: ask again soon
            actor.retry_at = time.monotonic() + _RETRY_S
            return
        if answer[0] == ERROR:
            error = unpack_exception(answer[1], -1)
            raise RuntimeError(
                f"{self.name}: {actor.describe()} could not load the stage's function: {error!r}. "
                "What it uses must be importable on the cluster's nodes (install it there, or pass "
                "RayExecutor(runtime_env=...))"
            ) from error
        _, actor.pid, (actor.node, actor.node_id) = answer
        actor.ready = True

    def _finished(self, ref: Any, results: list[Result]) -> None:
        actor, seq = self._running.pop(ref)
        actor.tasks.pop(seq, None)
        t0 = time.perf_counter()
        ray = self._ray
        try:
            answer = ray.get(ref, timeout=_GET_S)
        except ray.exceptions.RayActorError as e:
            self._lost(actor, seq, e, count=True)
            return
        except (
            ray.exceptions.ObjectLostError,
            ray.exceptions.GetTimeoutError,
        ) as e:  # its node went away
            self._lost(actor, seq, e, count=True)
            return
        if answer[0] == STALE:  # Ray restarted the actor before its installation: install it again
            self._lost(actor, seq, None, count=False)
            return
        kind, body, wall_s, cpu_s = answer
        self._payloads.pop(seq, None)
        self._router.done(seq)
        self.timing.add(
            wall_s, cpu_s, start=time.perf_counter() - wall_s, where=actor.describe(), pid=actor.pid
        )
        if kind == OK:
            results.append((seq, decode_result(body), None))
            self.stats.received(body.nbytes, time.perf_counter() - t0)
        else:
            results.append((seq, None, unpack_exception(body, actor.pid or -1)))
            self.stats.received(0, time.perf_counter() - t0)
        actor.stats.call(wall_s, cpu_s)
        self._retire_if_idle(actor)

    def _lost(self, actor: _Actor, seq: int, error: BaseException | None, count: bool) -> None:
        """Task ``seq`` got no result from ``actor``: queue it again (in order) and install the
        actor again once it is back; or raise. An actor the pool gave up while unused may have
        been killed for another pool's sake: its tasks go again, and that is no failure."""
        if self._workers.get(actor.slot) is not actor:
            error, count = None, False
        if error is not None and not self._restart:
            raise WorkerError(
                f"{self.name}: {actor.describe()} died ({error})", actor.pid or -1, "died"
            )
        if count and self._router.failed(seq):
            raise WorkerError(
                f"{self.name}: element {seq} was lost with {MAX_TASK_FAILURES} Ray actors "
                f"(the last, {actor.describe()}: {error})",
                actor.pid or -1,
                "died",
            )
        if actor.ready:
            actor.ready = False
            actor.stats.restarts += count
            actor.retry_at = time.monotonic() + (_RETRY_S if count else 0.0)
        self._router.requeue([self._payloads[seq]])
        self._retire_if_idle(actor)

    def _actor_died(self, actor: _Actor, error: BaseException) -> None:
        """Ray will not restart ``actor``: its tasks go back to the queue and a new actor takes
        its slot (or, with ``restart=False``, :class:`WorkerError`)."""
        if not self._restart:
            raise WorkerError(
                f"{self.name}: {actor.describe()} died ({error})", actor.pid or -1, "died"
            )
        for ref in actor.tasks.values():
            self._running.pop(ref, None)
        self._router.requeue(self._payloads[seq] for seq in actor.tasks)
        actor.tasks.clear()
        del self._workers[actor.slot]
        if actor.slot < self._size:
            self._add(actor.slot)
            self._workers[actor.slot].stats.restarts = actor.stats.restarts + 1


def decode_result(record: np.ndarray) -> Any:
    """The element in a record fetched from the object store, its tensors and arrays viewing it.

    Ray hands the record over read-only (an object is immutable to Ray), but it is this pool's
    alone: its reference is dropped once fetched, and the memory stays pinned while a view of it
    lives. Copying it out cost 2.7x the fetch on a 38 MB batch (fresh pages fault), so the views
    are writable like a ring record's in the process pool; a record off the 64-byte alignment the
    codec needs is copied out instead.
    """
    address = record.ctypes.data
    if address % ALIGN:
        return codec.decode(record)
    memory = (ctypes.c_uint8 * record.nbytes).from_address(address)
    memory.owner = record  # type: ignore[attr-defined]  # the record (and Ray's pin on the object) lives as long as a view does
    return codec.decode_view(np.frombuffer(memory, np.uint8))  # type: ignore[call-overload]  # a ctypes array is a buffer


def running_pools() -> list[RayActorPool]:
    """The Ray pools alive in this process."""
    return list(_POOLS)


def kill_an_actor(rng: random.Random, with_ray: bool = False) -> int | None:
    """Kill one actor of a Ray pool alive in this process, drawn with ``rng``: its process with
    SIGKILL where it runs on this machine, else (or ``with_ray``) with ``ray.kill(actor,
    no_restart=False)``, which Ray restarts as it restarts a crashed one. For fault tests
    (``torchpipe.testing.assert_exactly_once(..., kill=kill_an_actor)``).

    Returns:
        The pid of the actor killed, or None if no pool has an actor up.
    """
    import ray

    up = [
        actor
        for pool in running_pools()
        for actor in pool.actor_processes()
        if actor[1] is not None
    ]
    actors = cast("list[tuple[Any, int, str]]", up)  # their pids are known
    if not actors:
        return None
    handle, pid, node = rng.choice(sorted(actors, key=lambda actor: actor[1]))
    if with_ray or node != ray.get_runtime_context().get_node_id():
        ray.kill(handle, no_restart=False)
    else:
        os.kill(pid, signal.SIGKILL)
    return pid

"""How an epoch of ``num_workers="auto"`` over an IterableDataset settles its replicas: the first
batch of each replica started says where the others run, or the epoch starts over with more
(loader/replicas.py says why and how many). :class:`ReplicaStarts` is that part of the DataLoader's
worker iterator (:class:`~torchpipe.loader.workers.WorkerIterator`), a mixin sharing its state."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from torchpipe.core.tunable import WeakStage
from torchpipe.loader.fetch import Exhausted, FetchTask
from torchpipe.loader.memory import LoaderMemory, private_bytes
from torchpipe.loader.replicas import MAX_REPLICAS, ReplicaPlan
from torchpipe.runtime.cpu import usable_cpu_count, voluntary_switches
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.placement.measure import forced_now
from torchpipe.runtime.processes.pool import ProcessPool


class ReplicaStarts:
    """The replica count and placement of an IterableDataset's epoch under ``"auto"``, decided
    from the first batches (held until then: none is delivered before the count is final)."""

    _dispatch: Dispatcher
    _held: deque[tuple[int, Any, BaseException | None]]
    _pool: ProcessPool
    _plan: ReplicaPlan | None
    _task: FetchTask
    _memory: LoaderMemory
    _tp_state: Any
    _stage: WeakStage
    _task_slot: dict[int, int | None]
    _before_start_over: int | None
    _batch: int
    _slot: int
    _active: list[bool]
    _made: list[int]

    if TYPE_CHECKING:  # the iterator's own

        def _take(self) -> tuple[int, Any, BaseException | None]: ...
        def _new_pool(
            self, task: FetchTask, processes: int, fork_now: bool = True
        ) -> ProcessPool: ...

    def _decide_replicas(self, plan: ReplicaPlan) -> None:
        """Take the first batch of each replica started (one alone may be a slow start) and decide
        from their cost where the others run, or start the epoch over with more replicas. The
        batches are held until then: none is delivered before the count is final."""
        while self._dispatch.pending:
            self._held.append(self._take())
        calls, wall_s, cpu_s, asleep = replica_costs(self._pool)
        whole = all(
            error is None and not isinstance(value, Exhausted) for _, value, error in self._held
        )
        io = _waits_on_io(calls, wall_s, cpu_s, asleep)
        room = self._room() if whole and not plan.fixed and io else plan.replicas
        # batches that did not wait on I/O waited for a core: a process a core, like busy ones
        restart = (
            plan.decide(calls, wall_s, cpu_s if io else wall_s, usable_cpu_count(), room)
            if calls
            else None
        )
        if not whole and self._before_start_over is not None:
            # The dataset fails or ends early with as many replicas as the start-over asked for (it
            # splits files by num_workers, say) where fewer made their first batches: back to those.
            self._start_over(self._before_start_over, None)
            return
        if restart is None or not whole:  # an ended or failing replica: more replicas will not pay
            self._before_start_over = None
            plan.decided = plan.fixed = True
            self._tp_state.replicas, self._tp_state.tuned_workers = plan.replicas, plan.processes
            self._pool.resize(plan.processes)
            return
        self._start_over(restart, plan.replicas)

    def _start_over(self, replicas: int, before: int | None) -> None:
        """Start the epoch over with ``replicas``, a process each, their first batches held to be
        judged again where ``before`` (the count they replace) is given, else final."""
        self._before_start_over = before
        self._held.clear()  # made again, and split otherwise, by the new replicas
        self._task_slot.clear()
        self._tp_state.replicas = self._tp_state.tuned_workers = replicas
        # judged again: the count fixed, the first batches held; final: every replica placed now
        self._plan = ReplicaPlan(
            replicas, replicas, decided=None if before else replicas, fixed=True
        )
        self._task = self._task.with_replicas(replicas)
        pool = self._new_pool(self._task, replicas)
        pool.start()
        self._dispatch.switch(pool)  # the first replicas' pool, idle now, is closed
        self._pool = pool
        self._stage.stats.calls = pool.timing
        self._batch = self._slot = 0
        self._active, self._made = [True] * replicas, [0] * replicas

    def _room(self) -> int:
        """How many worker processes the RAM budget holds, from what the first one holds alone."""
        each = private_bytes(self._pool.pids[0]) if self._pool.pids else 0
        if not each:
            return MAX_REPLICAS
        return max(1, int(self._memory.budget // each))


def replica_costs(pool: Any) -> tuple[int, float, float, int]:
    """What the first batches of an IterableDataset's replicas cost in ``pool``'s workers: the
    calls, their wall and CPU seconds, and how often the workers went to sleep of their own accord
    (as :func:`~torchpipe.runtime.placement.measure.forced_costs` says, within it)."""
    calls, wall_s, cpu_s = pool.timing.totals()
    forced = forced_now()
    if forced is not None:  # asleep as it waits
        waiting = 1.0 - forced.cpu_s / forced.call_s if forced.call_s > 0 else 0.0
        return calls, forced.call_s * calls, forced.cpu_s * calls, round(4 * calls * waiting)
    return calls, wall_s, cpu_s, sum(voluntary_switches(pid) for pid in pool.pids)


def _waits_on_io(calls: int, wall_s: float, cpu_s: float, asleep: int) -> bool:
    """Whether the first batches waited on I/O, enough to spread the replicas over more
    processes than cores, or to start the epoch over with more: most of their time (3x
    their CPU time), 2 ms or more a batch, with their workers going to sleep on their own
    (``asleep`` more than 3 times a batch: besides waiting for their task). A busy machine's
    cores make a batch wait too, but not asleep: more processes or replicas would not help it,
    and the replica count decides what each batch holds."""
    return (
        calls > 0
        and wall_s >= 3 * cpu_s
        and (wall_s - cpu_s) / calls >= 0.002
        and asleep > 3 * calls
    )

"""The DataLoader's memory budget at work in its worker iterator: the predicted peak held before
workers are added, slots that give their pages back where it binds, workers given up past it, and
what each move leaves behind (docs/autotune.md says what a budget counts). :class:`BudgetedWorkers`
is that part of :class:`~torchpipe.loader.workers.WorkerIterator`, a mixin sharing its state; the
budget's figures and readings are loader/memory.py's."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torchpipe.core.tunable import WeakStage
from torchpipe.loader.memory import (
    ROOM_SHARE,
    LoaderMemory,
    hold_peak,
    mib,
    over_budget,
    predicted_peak,
    release_slot_pages,
    workers_fitting,
    workers_within,
)
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.auto_stage import AutoStage
from torchpipe.runtime.placement.costs import PROCESS, THREAD, most_processes
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.processes.output import slot_bytes
from torchpipe.runtime.processes.pool import ProcessPool
from torchpipe.runtime.recycle import RecycledStack


class BudgetedWorkers:
    """What the worker iterator does for its RAM budget: before a move, at each reading, past it."""

    _pool: ProcessPool
    _memory: LoaderMemory
    _placement: Placement | None
    _knob: LiveKnob | None
    _factor: int
    _asked_factor: int
    _recycled: RecycledStack | None
    _executors: AutoStage | None
    _dispatch: Dispatcher
    _num_workers: int
    _most_workers: int
    _tp_state: Any
    _stage: WeakStage

    @property
    def kept_bytes(self) -> int:
        """Bytes this process keeps to stack the next batches made here in (0 where none are, or
        once the batches moved to worker processes): a seam for tests and the budget's count."""
        return self._recycled.free_bytes if self._recycled is not None else 0

    def _processes(self, workers: int) -> ProcessPool:
        """The worker processes, ``workers`` of them (the zygote forked the first time), their
        slots' pages released first where the budget would not hold them at the peak."""
        if workers > self._pool.size:  # not the cap: the placement is moving now
            self._hold_slots(workers)
        self._pool.resize(workers)
        return self._pool

    def _hold_slots(self, workers: int) -> tuple[float, float]:
        """The slots of ``workers`` workers held on the predicted peak: fewer batches in flight
        (:meth:`_fit_in_flight`), then their pages released or kept (:func:`hold_peak`).
        Returns the batch's bytes and what this process holds, as predicted with."""
        batch, here = self._stage.stats.bytes_per_element, self._here_on_processes()
        self._fit_in_flight(workers, batch, here)
        hold_peak(self._memory, self._pool, workers, batch, here)
        return batch, here

    def _hold_peak(self, workers: int) -> None:
        """The budget held on the predicted peak (docs/autotune.md): the slots of ``workers``
        workers release or keep their pages by it, and "auto" caps its workers at those that fit."""
        batch, here = self._hold_slots(workers)
        placement = self._placement
        if placement is None or self._knob is None or batch <= 0:
            return
        most = self._knob.maximum if placement.most is None else placement.most
        # released slots at the batches in flight asked for: the cap does not move with them (a
        # loader's count misses what its zygote and workers share alone: jpeg's tree held 113 MB
        # where its count was 78, capped at 2 workers with one batch in flight each)
        fit = workers_fitting(self._memory, self._pool, most, batch, here, self._asked_factor)
        if 0 < fit < most:
            self._cap(placement, fit)
            self._memory.shed(f"workers past {fit}: past the budget at their predicted peak")

    def _fit_in_flight(self, workers: int, batch: float, here: float) -> None:
        """With ``num_workers="auto"``, where ``workers`` workers with their slots resident are
        predicted past the budget at their peak: one batch in flight a worker, not
        ``prefetch_factor``, before any slot gives its pages back (:func:`hold_peak`). Each
        worker's ring then keeps two slots (the batch in flight, the one the loop holds): a slot
        less than released slots with two in flight, and no page faults. ``jpeg``, 2 workers
        ahead of a 10 ms step: 83 MB at 1855 img/s, released slots 84 MB at 1458-1699, torch's 2
        workers 87 MB at 1488-1950. ``prefetch_factor`` again once that many are predicted within
        :data:`~torchpipe.loader.memory.ROOM_SHARE` of the budget and the last reading has the
        room."""
        memory, pool, asked = self._memory, self._pool, self._asked_factor
        if self._placement is None or batch <= 0 or workers < 1 or asked <= 1:
            return
        full = predicted_peak(memory, pool, workers, batch, here, True, asked)
        if self._factor > 1 and full > memory.budget:
            self._set_factor(1)
            why = f"{mib(full)} predicted at the peak with {asked} batches in flight a worker"
            memory.in_flight_why = f"{why}, past the budget of {mib(memory.budget)}"
            memory.shed(f"batches in flight: 1 a worker, their slots kept ({why})")
        elif self._factor < asked and full <= ROOM_SHARE * memory.budget:
            extra = workers * (asked - self._factor) * slot_bytes(int(batch))
            if memory.room_for(extra):
                self._set_factor(asked)
                memory.in_flight_why = (
                    f"{mib(full)} predicted at the peak with {asked} batches in flight a worker "
                    f"is within {ROOM_SHARE:.0%} of the budget of {mib(memory.budget)}"
                )
                memory.settle()

    def _set_factor(self, factor: int) -> None:
        """Batches in flight a worker from now on (each ring takes as many slots at its next batch)."""
        self._factor = self._memory.in_flight = factor
        self._pool.set_per_worker(factor)

    def _here_on_processes(self) -> float:
        """What this process holds of the loader's while its batches are made by worker processes:
        what it holds now where they are, else nothing (the memory kept to stack batches made
        here, and the batches its threads made, go when the batches move to processes; counting
        them in a worker placement's peak cost tfrecord's budget row its second worker)."""
        placement = self._placement
        if placement is not None and placement.kind != PROCESS:
            return 0.0
        return held_here(weakref.ref(self))

    def _moved(self, kind: str, workers: int) -> None:
        """After a move: the worker count later epochs start with, and the most the autotuner may
        ask for where the batches now are (on processes, one a core for batches that compute:
        :func:`~torchpipe.runtime.placement.costs.most_processes`; a budget's cap stands). (What
        this process keeps to make batches, and the parked workers' slots, are the
        :class:`~torchpipe.runtime.placement.auto_stage.AutoStage`'s: kept only while the batches
        are made here, and given back while a trial runs elsewhere; the workers stop then where
        :meth:`_parks` says a budget binds.)"""
        self._tp_state.tuned_workers = workers
        self._num_workers = workers
        placement = self._placement
        if self._knob is None or placement is None:
            return
        most = self._most_workers
        if kind == PROCESS:  # one a core for batches that compute (most_processes)
            policy = placement.policy
            most = min(most, most_processes(policy.costs if policy else None, usable_cpu_count()))
        if placement.most is not None:  # a budget's cap stands
            most = min(most, placement.most)
        self._knob.maximum = max(most, workers, self._knob.minimum)

    def _pages_back(self) -> bool:
        """Whether the parked workers' slots may keep their pages again (not where a budget
        released them)."""
        return self._memory.slot_pages != "released"

    def _parks(self) -> bool:
        """Whether the workers stay up while a trial runs elsewhere: not while the budget binds
        (it capped the workers, lowered the batches in flight or released the slots' pages), as
        their heaps would peak with the trial's memory (``jpeg``'s budget row, capped
        at 2 workers, on two threads beside two parked workers: 106-148 MB against its budget
        of 100). Nor, then, does a move send the executor the calls go to a batch before the one
        they left has finished its own (:meth:`~torchpipe.loader.workers.WorkerIterator._fill`)."""
        capped = self._placement is not None and self._placement.most is not None
        return self._pages_back() and self._factor >= self._asked_factor and not capped

    def _keep_to_budget(self, memory: LoaderMemory) -> None:
        """Past the memory budget: first the ring slots give their pages back once their batch is
        released (:func:`release_slot_pages`: every worker is kept); then, with
        ``num_workers="auto"``, give up workers (down to one; as many at once as the reading says
        are past it, at an equal share each),
        then its ring slots (batches in flight, down to one), then the last worker (batches made
        here), then the zygote; the caps hold for later epochs. A count the user chose (or the
        replicas of an IterableDataset, which decide what each batch holds) is kept: a warning
        says once what the loader holds."""
        if release_slot_pages(memory, self._pool):
            return  # memory buys workers: what the loader holds is read again first
        placement = self._placement
        if placement is None:
            self._warn_over_budget(memory)
            return
        step = self._give_up_one(placement, memory)
        if step is not None:  # None: nothing is left to give up: what is held is not the loader's
            memory.shed(step)

    def _warn_over_budget(self, memory: LoaderMemory) -> None:
        """Workers the user chose (or the replicas' count) are kept past the budget: say once
        what the loader holds (the warning points where :meth:`_keep_to_budget` was called from)."""
        if not memory.warned:
            memory.warned = True
            warnings.warn(over_budget(memory, self._pool.size), stacklevel=4)
        memory.over = False

    def _give_up_one(self, placement: Placement, memory: LoaderMemory) -> str | None:
        """The next step past the budget (:meth:`_keep_to_budget`'s order), taken: what was given
        up, for :meth:`~torchpipe.loader.memory.LoaderMemory.shed`; None where nothing is left."""
        if placement.workers > 1:
            most = placement.workers
            keep = workers_within(memory.held, memory.budget, most)
            self._cap(placement, keep)
            if keep == most - 1:
                return f"worker {most} of {most}"
            return f"worker {keep + 1} to {most} of {most}"
        if placement.workers == 1 and self._factor > 1:
            self._set_factor(self._factor - 1)
            return f"a ring slot: {self._factor} batches in flight a worker"
        if placement.workers == 1:
            self._cap(placement, 0)
            return "the last worker: batches made in this process"
        if self._pool.size:
            self._pool.resize(0)
            return "the parked workers"
        if self._pool.process_ids:
            self._pool.release_zygote()
            return "the workers' zygote"
        return None

    def _cap(self, placement: Placement, most: int) -> None:
        if self._knob is not None:
            self._knob.maximum = most
        placement.cap(most)


def held_here(ref: Callable[[], BudgetedWorkers | None]) -> float:
    """The bytes a DataLoader's iterator holds in this process (0 once it is gone): batches made
    here on threads and not handed out (each task in flight holds one, or will), the elements of
    the batch each thread is making (in its own arena: ``jpeg``'s 2 threads held 22 MB each
    where their batches counted 9), and the memory kept for the next ones. A batch handed out is
    the training loop's, as with torch's workers."""
    iterator = ref()
    if iterator is None or iterator._recycled is None:
        return 0.0
    executors = iterator._executors
    batches = 0
    if executors is not None and executors.kind == THREAD:
        pending = iterator._dispatch.pending
        batches = pending + min(pending, executors.placement.workers)  # made, and being made
    return iterator.kept_bytes + batches * iterator._stage.stats.bytes_per_element

"""Where a DataLoader's batches are made: torch's fetch logic, run through torchpipe's runtime.

:class:`WorkerIterator` is what ``iter(tp.DataLoader(...))`` returns for a map-style or iterable
dataset when ``num_workers > 0`` or ``"auto"`` (and workers can fork). Each batch is a task
numbered in sampler order, run by torch's own fetcher and collation, and delivered through the
runtime's dispatcher (bounded waits, the stall check, in order or as completed).

- ``num_workers=n``: ``n`` worker processes forked from a zygote, torch's seeds and order (batch
  ``k`` to worker ``k % n``), batches stacked straight into shared memory; a dead worker is
  replaced and its batches fetched again.
- ``num_workers="auto"`` over a map-style dataset: the runtime's policy places the batches in
  this process (inline), on threads or on worker processes, from what the first batches cost, and
  moves them while the epoch runs when measurements say another place is faster; the autotuner
  sizes the pool. The executors, their moves and the knob are the runtime's auto stage
  (:class:`~torchpipe.runtime.placement.auto_stage.AutoStage`), as for a parallel map. Every
  batch's global RNGs are seeded from the epoch's base seed and the batch's index, so with seeds
  set (a ``generator``, ``torch.manual_seed``) augmentation is the same on every run wherever a
  batch was made; a dataset that draws from them then never runs on threads, which share them
  (without seeds it may: docs/determinism.md).
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.utils.data._utils.collate as torch_collate
from torch.utils.data import IterableDataset
from torch.utils.data import dataloader as torch_dataloader
from torch.utils.data._utils.pin_memory import pin_memory

from torchpipe.autotune.autotuner import Autotuner, ConsumerClock
from torchpipe.autotune.live import start_look
from torchpipe.autotune.report import PipelineStats, pipeline_stats
from torchpipe.autotune.tuner import Budget
from torchpipe.core.stats import IteratorStats
from torchpipe.core.tunable import POOL, WeakStage
from torchpipe.loader.fetch import DataLoader, Exhausted, FetchTask, LocalFetch, SpanWhenProfiled
from torchpipe.loader.memory import (
    LoaderMemory,
    default_budget,
    hold_peak,
    over_budget,
    pool_holdings,
    private_bytes,
    release_slot_pages,
    ring_limit,
    trim_heap,
    workers_fitting,
    workers_within,
)
from torchpipe.loader.replicas import MAX_REPLICAS, ReplicaPlan, io_replicas
from torchpipe.options import DEFAULT_STALL_TIMEOUT_S
from torchpipe.randomness import (
    GLOBAL_RNGS,
    GlobalDraws,
    global_rng_states,
    restore_global_rng_states,
    seeds_were_set,
)
from torchpipe.runtime import interrupts
from torchpipe.runtime.cpu import usable_cpu_count, voluntary_switches
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.auto_stage import AutoStage, StageCalls, pass_candidates
from torchpipe.runtime.placement.measure import measure_calls
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.placement.policy import INLINE, KINDS, PROCESS, THREAD, Policy
from torchpipe.runtime.processes.pool import ProcessPool
from torchpipe.runtime.processes.worker import MAX_RING_BYTES
from torchpipe.runtime.recycle import RecycledStack

STAGE = "DataLoader workers"
NOT_ON_THREADS = (
    "the dataset draws from the global RNGs (random, numpy, torch), which threads share, and seeds were set "
    "(a generator given, or torch.manual_seed) so its draws must repeat on every run"
)
"""Why ``num_workers="auto"`` makes no batch on threads, in ``loader.stats()``."""


class WorkerIterator(SpanWhenProfiled, torch_dataloader._BaseDataLoaderIter):
    """Batches made off the consumer's path (or, with ``"auto"``, wherever is fastest), delivered
    in sampler order (or as they finish with ``in_order=False``).

    Like torch's multiprocessing iterator it keeps ``prefetch_factor`` batches per worker in
    flight, skips workers whose IterableDataset replica has ended, and raises after ``timeout``
    seconds without a batch. Results arrive through shared memory; a dead worker is replaced
    and its batches fetched again.
    """

    def __init__(self, loader: DataLoader) -> None:
        interrupts.watch()
        super().__init__(loader)
        self._in_order = loader.in_order
        self._factor = loader.prefetch_factor or 2
        self._tp_state = state = vars(loader)["_tp"]
        iterable = self._dataset_kind == torch_dataloader._DatasetKind.Iterable
        self._auto = state.workers_auto and not iterable
        most = (
            max(self._num_workers, 2 * usable_cpu_count())
            if state.workers_auto
            else self._num_workers
        )
        # auto over an IterableDataset: `most` replicas (or what an earlier epoch decided), on
        # processes decided from the first batches
        self._plan: ReplicaPlan | None = None
        if state.workers_auto and iterable:
            most = state.replicas or most
            self._plan = ReplicaPlan(
                most, self._num_workers, state.tuned_workers, fixed=state.replicas is not None
            )
        # the plan's first batches
        self._held: deque[tuple[int, Any, BaseException | None]] = deque()
        # the replicas an epoch had before it started over with more
        self._before_start_over: int | None = None
        processes = self._plan.processes if self._plan is not None else self._num_workers
        # "auto": the zygote is forked when batches first go to processes (the first decision is
        # made before the tuner's thread starts), not for an epoch that makes them here (its fork
        # and stop took ~10 ms, its memory the epoch)
        self._task = FetchTask(loader, int(self._base_seed), most, self._auto)
        self._options, given = state.autotune, state.autotune.ram_budget
        # the default budget: a share of what was available at the first epoch
        if state.memory is None:
            state.memory = LoaderMemory(
                default_budget() if given is None else given, given is not None
            )
        self._memory: LoaderMemory = state.memory
        lean = given is not None and state.workers_auto  # a budget the user gave: rings stay small
        self._ring_limit = (
            ring_limit(given, min(most, usable_cpu_count())) if lean else MAX_RING_BYTES
        )
        self._pool = self._new_pool(
            self._task, 0 if self._auto else processes, fork_now=not self._auto
        )
        # what the autotuner and stats() see: this iterator's answers, held weakly (the tuner's
        # thread must not keep a dropped iterator, and its workers, alive)
        self._stage = WeakStage(STAGE, POOL, self)
        self._executors: AutoStage | None = None  # "auto": where batches are made, and the moves
        self._recycled: RecycledStack | None = None  # "auto": the memory of batches made here
        self._parked_released = False  # "auto": the parked workers' slots gave their pages back
        self._placement: Placement | None = None
        self._knob: LiveKnob | None = None
        # Batch k goes to worker (or replica) k % n: a replica's batches must, and fixed workers
        # keep torch's order; with in_order=False a map-style batch goes to the least busy worker.
        self._pinned = iterable or (not self._auto and self._in_order)
        if self._auto:
            self._start_auto(loader, most)
        else:
            self._dispatch = Dispatcher(STAGE, self._pool, DEFAULT_STALL_TIMEOUT_S)
            self._pool.start()
        self._tuner: Autotuner | None = None
        self._tuner_stop: weakref.finalize | None = None
        self._epoch = -1
        self._seq = 0  # sequence numbers run on across epochs: late results of a broken-off
        self._start_epoch()  # epoch can never be taken for this one's

    @classmethod
    def describe(cls, loader: DataLoader) -> list[str]:
        """How an epoch of ``loader`` runs on worker processes, for ``tp.explain(loader)``."""
        state, dataset, collate_fn = vars(loader)["_tp"], loader.dataset, loader.collate_fn
        iterable = isinstance(dataset, IterableDataset)
        fetch = "__getitems__" if hasattr(dataset, "__getitems__") else "dataset[i] per index"
        if iterable:
            fetch = "the worker's replica's next items"
        collate = getattr(collate_fn, "__name__", type(collate_fn).__name__)
        to_shm = (
            " (tensors stacked straight into shared memory)"
            if collate_fn is torch_collate.default_collate
            else ""
        )
        return [
            f"  {loader.num_workers} worker processes forked from a zygote{_sizing(state, iterable)}; a task per "
            f"batch: {fetch}, then {collate}{to_shm}; {loader.prefetch_factor or 2} batches in flight per worker, "
            f"delivered {'in sampler order' if loader.in_order else 'as they finish'}; a dead worker is replaced"
        ]

    def _new_pool(self, task: FetchTask, processes: int, fork_now: bool = True) -> ProcessPool:
        """Worker processes for ``task``, ``prefetch_factor`` batches in flight each (their rings
        hold those and the one the consumer holds); under a RAM budget their rings stay small and
        they give freed memory back (large results then cost page faults again)."""
        lean = self._ring_limit < MAX_RING_BYTES
        return ProcessPool(
            task,
            processes,
            STAGE,
            fork_now=fork_now,
            ring_limit=self._ring_limit,
            keep_freed=not lean,
            per_worker=self._factor,
        )

    def _start_auto(self, loader: DataLoader, most: int) -> None:
        """``num_workers="auto"``: the policy (kept by the loader across epochs) places batches, in
        this process, on threads or on the worker processes, through the runtime's auto stage."""
        state = self._tp_state
        if state.policy is None:
            state.policy = Policy(KINDS, usable_cpu_count())
        policy = state.policy
        policy.candidates = pass_candidates(
            inline=True,
            processes=True,
            last=policy.kind,
            costs=policy.costs,
            measured=policy.measured,
            cores=policy.cores,
        )
        drawn = (
            state.drawn_rngs if state.drawn_rngs is not None else GLOBAL_RNGS
        )  # all, until measured
        seed = int(self._base_seed)
        # batches made here reuse the memory of those freed
        self._recycled = memory = RecycledStack()
        self._local = {
            INLINE: LocalFetch(loader, seed, drawn, memory),
            THREAD: LocalFetch(loader, seed, (), memory),
        }
        # with the default generator's seed, whether draws must repeat
        self._generator = loader.generator
        calls = StageCalls(self._local[INLINE], self._local[THREAD], processes=self._processes)
        self._executors = AutoStage(
            STAGE,
            calls,
            self._pool.timing,
            policy,
            learned=state.learned,
            stall_s=DEFAULT_STALL_TIMEOUT_S,
            on_move=self._moved,
        )
        self._dispatch, self._placement = self._executors.dispatcher, self._executors.placement
        self._knob = self._executors.add_knob(0, 0, most, apply=_weakly(self.resize))

    def _processes(self, workers: int) -> ProcessPool:
        """The worker processes, ``workers`` of them (the zygote forked the first time), their
        slots' pages released first where the budget would not hold them at the peak."""
        if workers > self._pool.size:  # not the cap: the placement is moving now
            batch, here = self._stage.stats.bytes_per_element, _held_here(weakref.ref(self))
            hold_peak(self._memory, self._pool, workers, batch, here)
        self._pool.resize(workers)
        return self._pool

    def _hold_peak(self, workers: int) -> None:
        """The budget held on the predicted peak (docs/autotune.md): the slots of ``workers``
        workers release or keep their pages by it, and "auto" caps its workers at those that fit."""
        batch, here = self._stage.stats.bytes_per_element, _held_here(weakref.ref(self))
        hold_peak(self._memory, self._pool, workers, batch, here)
        placement = self._placement
        if placement is None or self._knob is None or batch <= 0:
            return
        most = self._knob.maximum if placement.most is None else placement.most
        fit = workers_fitting(self._memory, self._pool, most, batch, here)
        if 0 < fit < most:
            self._cap(placement, fit)
            self._memory.shed(f"workers past {fit}: past the budget at their predicted peak")

    def _moved(self, kind: str, workers: int) -> None:
        """After a move: only the place that makes the batches now keeps memory for the next. To
        the workers, what this process kept to make them goes; away from them, the workers parked
        for a trial elsewhere give their slots' pages back as their batches are taken (else their
        rings and this process's batches peak together), and keep them again on the way back
        unless a budget released them."""
        self._tp_state.tuned_workers = workers
        self._num_workers = workers
        pool, memory = self._pool, self._memory
        if kind == PROCESS:
            if self._recycled is not None:
                self._recycled.drop_free()
                trim_heap()
            if self._parked_released and memory.slot_pages != "released":
                pool.set_slot_pages(True)
            self._parked_released = False
        elif pool.size and pool.slot_pages:
            pool.set_slot_pages(False)
            self._parked_released = True

    # The autotuner's contract (core/tunable.py), answered for the WeakStage that holds this weakly.

    def children(self) -> list[Any]:
        return []

    def knobs(self) -> list[LiveKnob]:
        return [self._knob] if self._knob is not None else []

    def parallelism(self) -> int:
        """Worker processes or threads making batches now (0: in this process)."""
        return self._placement.workers if self._placement is not None else self._pool.size

    def buffer_slots(self) -> int:
        return self._window()

    def calls_in_processes(self) -> bool:
        return self._placement is None or self._placement.kind == PROCESS

    def executor_report(self) -> dict[str, Any]:
        """Where batches are made, for ``loader.stats()``, as a parallel map reports it: the
        ``executor`` kind, its ``workers``, the worker processes' ``pids`` and, with
        ``num_workers="auto"``, what its policy measured (:meth:`AutoStage.policy_report`)."""
        kind = self._placement.kind if self._placement is not None else PROCESS
        report = {"executor": kind, "workers": self.parallelism(), "pids": self._pool.pids}
        if self._executors is not None:
            report.update(self._executors.policy_report(NOT_ON_THREADS))
        return report

    def resize(self, workers: int) -> None:
        """The autotuner's request: make batches on ``workers`` workers (0: in this process)."""
        assert self._placement is not None  # the knob exists with num_workers="auto"
        self._placement.resize(workers)
        self._fill()

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        """The next epoch with the same (persistent) workers, as torch's iterator does."""
        super()._reset(loader, first_iter)
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._stop_tuner()
        here = weakref.ref(self)  # the watcher must not keep the iterator alive
        self._watching = self._memory.watch(
            pool_holdings(self._pool, lambda: _held_here(here)), id(self._pool)
        )
        self._dispatch.forget()
        self._clock, self._started = ConsumerClock(), start_look()
        self._stage.stats = IteratorStats()
        self._stage.stats.calls = self._pool.timing
        if self._knob is not None and self._options.enabled:
            # the budget is read at the first round (~0.4 ms: an epoch may end sooner)
            options = self._options
            budget = lambda: Budget.of_machine(options.cpu_budget, options.ram_budget)  # noqa: E731
            # the tree is this one stage
            self._tuner = Autotuner(self._stage, self._clock, budget)  # type: ignore[arg-type]
            if self._tuner_stop is not None:
                self._tuner_stop.detach()
            # a dropped iterator stops it
            self._tuner_stop = weakref.finalize(self, self._tuner.stop)
        self._epoch += 1
        self._batch = 0  # batches drawn from the sampler this epoch (each one's seed)
        self._active = [True] * (
            self._plan.replicas if self._plan is not None else self._num_workers
        )
        # batches asked of each worker's (or replica's) dataset
        self._made = [0] * len(self._active)
        self._slot = 0
        self._task_slot: dict[int, int | None] = {}
        self._sampler_done = False
        # a batch drawn from the sampler, not yet made
        self._primed: tuple[int, int, Any] | None = None
        if self._placement is not None:
            self._place()
        self._fill()

    def _place(self) -> None:
        """Where this epoch's batches go: where the last epoch left them, or, the first time, where
        the policy puts them after a few batches made here and measured. A dataset that draws from
        the global RNGs stays off threads (which share them) only where seeds were set: without,
        its draws differ on every run anyway (:func:`seeds_were_set`)."""
        policy, state, placement = self._tp_state.policy, self._tp_state, self._placement
        assert policy is not None and placement is not None  # num_workers="auto" (_start_auto)
        if policy.kind is not None:
            if placement.kind == policy.kind and placement.workers == (state.tuned_workers or 0):
                placement.new_pass()  # persistent workers: the batches stay where they were made
            else:
                placement.move(policy.kind, state.tuned_workers or 0, again=True)
            return

        def drawn(draws: GlobalDraws) -> None:  # from here on only these are seeded and put back
            state.drawn_rngs = self._local[INLINE].rngs = tuple(sorted(draws.drawn))

        # The sampler draws its epoch's seed from the global RNGs when its first batch is drawn (as
        # torch's does): that draw must stay, the measured batches' own draws must not.
        self._primed = self._next_payload()
        # once: putting them back after every measured batch would be measured
        saved = global_rng_states()
        try:
            costs, _ = measure_calls(self._run_inline, on_draws=drawn)
        finally:
            restore_global_rng_states(saved)
        must_repeat = bool(state.drawn_rngs) and seeds_were_set(self._generator)
        self._hold_peak(0)  # the budget caps the workers before the first move, not after it
        placement.decide(costs.without_threads() if must_repeat else costs)

    def _run_inline(self, limit: int) -> list[Any]:
        """The first batches, made here and timed: the policy's first measurement."""
        assert self._executors is not None  # num_workers="auto" (_start_auto)
        inline = self._local[INLINE]
        results = self._executors.run_inline(
            limit, self._next_call, lambda seq, payload: inline.seeded(payload)
        )
        made = next((value for value in results if value is not None), None)
        if made is not None and not self._stage.stats.bytes_n:
            self._stage.stats.sample_bytes(made)  # the peak is predicted before the first move
        return results

    def _next_call(self) -> tuple[int, Any] | None:
        """The next batch drawn from the sampler as a numbered call, made here; None at the end."""
        payload = None if self._sampler_done else self._next_payload()
        if payload is None:
            return None
        self._task_slot[self._seq] = None
        self._seq += 1
        return self._seq - 1, payload

    def _next_payload(self) -> tuple[int, int, Any] | None:
        if self._primed is not None:
            payload, self._primed = self._primed, None
            return payload
        try:
            index = self._next_index()
        except StopIteration:
            self._sampler_done = True
            return None
        self._batch += 1
        return self._epoch, self._batch - 1, index

    def _window(self) -> int:
        """Batches in flight: ``prefetch_factor`` per worker (one at a time inline)."""
        if self._placement is not None and self._placement.kind == INLINE:
            return 1
        workers = self._placement.workers if self._placement is not None else self._pool.size
        return self._factor * max(workers, 1)

    def _fill(self) -> None:
        """Send batches until ``prefetch_factor`` per worker are in flight (or none are left)."""
        while (
            self._dispatch.pending < self._window()
            and not self._sampler_done
            and (self._auto or any(self._active))
        ):
            replica = host = None
            if self._pinned:  # workers (or replicas) get torch's order: batch k to k % n
                replica = self._next_active()
                host = self._host(replica)
                if host is None:
                    return  # the first batches' cost decides where the other replicas run
            payload: tuple[Any, ...] | None = self._next_payload()
            if payload is None:
                return
            self._task_slot[self._seq] = replica
            if host is None:
                self._dispatch.submit(self._seq, payload)
            else:
                assert replica is not None  # pinned: each batch has its replica
                self._slot = (replica + 1) % len(self._active)
                if self._dataset_kind == torch_dataloader._DatasetKind.Iterable:
                    payload = (*payload, replica, self._made[replica])
                    self._made[replica] += 1
                self._dispatch.submit(self._seq, payload, slot=host)
            self._seq += 1

    def _next_active(self) -> int:
        """The worker (or replica) whose turn it is: the first from ``_slot`` on that has not ended."""
        n = len(self._active)
        return next(r % n for r in range(self._slot, self._slot + n) if self._active[r % n])

    def _host(self, replica: int) -> int | None:
        """The worker slot that makes ``replica``'s batches; None while that waits for a measurement."""
        return replica if self._plan is None else self._plan.host(replica)

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

    def skip(self, count: int) -> None:
        """Resume support: drop ``count`` batches (map-style: drawn from the sampler, not fetched)."""
        for _ in range(count):
            if (
                self._dataset_kind == torch_dataloader._DatasetKind.Map
                and not self._dispatch.pending
            ):
                if self._next_payload() is None:
                    raise StopIteration  # the caller says the state is not this epoch's
            else:
                self._next_data()
            self._num_yielded += 1

    def _next_data(self) -> Any:
        interrupts.raise_dropped()  # a Ctrl-C that a finalizer of the last batch swallowed
        self._clock.enter()
        if self._knob is not None:
            self._knob.take_request()
        stats, started = self._stage.stats, time.perf_counter()
        if self._executors is not None and self._executors.runs_here():
            value, error, waited = self._fetch_here(self._executors), None, 0.0
        else:
            value, error, waited = self._receive()
        stats.produced += 1
        stats.wait_s += waited
        if stats.unclocked:  # cheap batches are clocked one in a few (see IteratorStats.clocked)
            stats.unclocked -= 1
        else:
            stats.look(self._dispatch.finished, self._window())
            stats.clocked(time.perf_counter() - started, waited)
        stats.sample_bytes(value)
        if self._placement is not None:
            self._placement.delivered(stats.wall_s)
        if self._memory.over:
            self._keep_to_budget(self._memory)
        elif self._memory.new_reading():  # judged again on what the last reading measured
            # workers parked for a trial elsewhere keep their slots released (_moved)
            self._hold_peak(self._pool.size if self.calls_in_processes() else 0)
        if error is not None:
            raise error
        if self._tuner is not None and not self._tuner.started:
            self._tuner.tick()  # as a pipeline's: the first batch starts its first window, the first round its thread
        self._clock.leave()
        return pin_memory(value, self._pin_memory_device) if self._pin_memory else value

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
            if not memory.warned:
                memory.warned = True
                warnings.warn(over_budget(memory, self._pool.size), stacklevel=3)
            memory.over = False
            return
        if placement.workers > 1:
            most = placement.workers
            keep = workers_within(memory.held, memory.budget, most)
            step = (
                f"worker {most} of {most}"
                if keep == most - 1
                else f"worker {keep + 1} to {most} of {most}"
            )
            self._cap(placement, keep)
        elif placement.workers == 1 and self._factor > 1:
            self._factor -= 1
            self._pool.set_per_worker(self._factor)
            step = f"a ring slot: {self._factor} batches in flight a worker"
        elif placement.workers == 1:
            step = "the last worker: batches made in this process"
            self._cap(placement, 0)
        elif self._pool.size:
            step = "the parked workers"
            self._pool.resize(0)
        elif self._pool.process_ids:
            step = "the workers' zygote"
            self._pool.release_zygote()
        else:
            return  # nothing is left to give up: what is held is not the loader's
        memory.shed(step)

    def _cap(self, placement: Placement, most: int) -> None:
        if self._knob is not None:
            self._knob.maximum = most
        placement.cap(most)

    def _fetch_here(self, executors: AutoStage) -> Any:
        """The next batch, made on this thread (inline, nothing in flight): no dispatch needed."""
        payload = self._next_payload()
        if payload is None:
            self._shutdown_if_done()
            raise StopIteration
        self._seq += 1
        return executors.call_here(self._seq - 1, payload)

    def _receive(self) -> tuple[Any, BaseException | None, float]:
        """The next batch from the dispatcher (sent ahead to an executor): value, error, seconds waited."""
        waited = 0.0
        while True:
            self._fill()
            if not self._dispatch.pending and not self._held:
                self._shutdown_if_done()
                raise StopIteration
            before = self._dispatch.wait_s
            if self._plan is not None and not self._plan.decided:
                self._decide_replicas(self._plan)
                waited += self._dispatch.wait_s - before
                continue
            seq, value, error = self._held.popleft() if self._held else self._take()
            waited += self._dispatch.wait_s - before
            slot = self._task_slot.pop(seq)
            if isinstance(value, Exhausted):
                assert slot is not None  # a replica's end
                if value.on_replay is not None and self._active[slot]:
                    raise RuntimeError(
                        f"a worker running IterableDataset replica {slot} died; its replacement replayed the replica "
                        f"to skip what was delivered, but it ended after {value.on_replay} batches where it had made "
                        "more: it yields other elements on each run, so the epoch cannot go on without losing data"
                    )
                self._active[slot] = False
                continue
            return value, error, waited

    def _take(self) -> tuple[int, Any, BaseException | None]:
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        try:
            return self._dispatch.take(self._in_order, deadline)
        except TimeoutError:
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from None

    def stats(self) -> PipelineStats:
        """This epoch's numbers: batches, the time per batch, the loop's waiting, where batches were
        made and by how many (and the tuner's rounds, with ``num_workers="auto"``)."""
        decisions = list(self._tuner.decisions) if self._tuner is not None else []
        stats = pipeline_stats(self._stage, self._started, self._clock.outside_s(), decisions)  # type: ignore[arg-type]
        where = stats[0]  # executor, workers, pids: the stage's executor_report
        where["knobs"] = {
            "num_workers": where["workers"],
            "in_flight": self._window(),
            "executor": where["executor"],
        }
        where["memory"] = self._memory.report()
        return stats

    def _stop_tuner(self) -> None:
        if self._tuner is not None:
            self._tuner.stop()

    def _shutdown_if_done(self) -> None:
        if self._placement is not None:
            self._placement.finish(self._stage.stats.wall_s)
        # loader.stats() describes this pass until the next
        self._tp_state.last_stats = self.stats()
        self._stop_tuner()
        if not self._persistent_workers:
            self._watching.set()
            self._dispatch.close()
            self._pool.close()

    def __del__(self) -> None:
        state = getattr(self, "_tp_state", None)
        if (
            state is not None
            and getattr(self, "_stage", None) is not None
            and self._stage.stats.produced
        ):
            try:
                state.last_stats = self.stats()  # a pass left mid-epoch, as far as it went
            except Exception:  # noqa: BLE001 - a report is not worth failing a collection over
                pass
        watching = getattr(self, "_watching", None)
        if watching is not None:
            watching.set()
        for part in ("_dispatch", "_pool"):
            closing = getattr(self, part, None)
            if closing is not None:
                closing.close()


def _sizing(state: Any, iterable: bool) -> str:
    """How ``num_workers="auto"`` sizes a loader's workers (nothing for a fixed count), for explain()."""
    if not state.workers_auto:
        return ""
    cores = usable_cpu_count()
    if not iterable:
        return f" (resized by the autotuner: 1 to {2 * cores})"
    more = "" if state.replicas else f" ({io_replicas(cores)} where the first batches wait on I/O)"
    return f" running {state.replicas or 2 * cores} replicas{more}, one a process where they wait, else in turn"


def replica_costs(pool: Any) -> tuple[int, float, float, int]:
    """What the first batches of an IterableDataset's replicas cost in ``pool``'s workers: the
    calls, their wall and CPU seconds, and how often the workers went to sleep of their own accord."""
    calls, wall_s, cpu_s = pool.timing.totals()
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


def _held_here(ref: weakref.ref[WorkerIterator]) -> float:
    """The bytes a DataLoader's iterator holds in this process (0 once it is gone): batches made
    here on threads and not handed out (each task in flight holds one, or will), and the memory
    kept for the next ones. A batch handed out is the training loop's, as with torch's workers."""
    iterator = ref()
    if iterator is None or iterator._recycled is None:
        return 0.0
    executors = iterator._executors
    made_here = executors is not None and executors.kind == THREAD
    pending = iterator._dispatch.pending if made_here else 0
    return iterator._recycled.free_bytes + pending * iterator._stage.stats.bytes_per_element


def _weakly(method: Callable[[int], None]) -> Callable[[int], None]:
    """``method``, holding its object weakly (a no-op once it is gone): the tuner's thread calls it."""
    ref = weakref.WeakMethod(method)

    def call(value: int) -> None:
        live = ref()
        if live is not None:
            live(value)

    return call

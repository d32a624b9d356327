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

What it does for its RAM budget is loader/budget.py's (:class:`BudgetedWorkers`), how an
IterableDataset's epoch settles its replicas loader/replica_starts.py's (:class:`ReplicaStarts`),
where an auto epoch's batches go and how the first are measured loader/first_batches.py's
(:class:`FirstBatches`, with a worker's head start): the mixins share its state. It answers
the autotuner's contract itself, held weakly by a :class:`~torchpipe.core.tunable.WeakStage`.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
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
from torchpipe.core.tunable import POOL, WeakStage, weakly
from torchpipe.loader.budget import BudgetedWorkers, held_here
from torchpipe.loader.fetch import DataLoader, Exhausted, FetchTask, LoaderNext, LocalFetch
from torchpipe.loader.first_batches import Call, FirstBatches, HeadStart
from torchpipe.loader.memory import (
    LoaderMemory,
    default_budget,
    pool_holdings,
    ring_limit,
)
from torchpipe.loader.replica_starts import ReplicaStarts
from torchpipe.loader.replicas import ReplicaPlan, io_replicas
from torchpipe.options import DEFAULT_STALL_TIMEOUT_S
from torchpipe.randomness import GLOBAL_RNGS
from torchpipe.runtime import interrupts
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.auto_stage import AutoStage, StageCalls, pass_candidates
from torchpipe.runtime.placement.costs import INLINE, KINDS, PROCESS, THREAD
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.placement.policy import Policy
from torchpipe.runtime.processes.pool import ProcessPool
from torchpipe.runtime.processes.worker import MAX_RING_BYTES
from torchpipe.runtime.recycle import RecycledStack

STAGE = "DataLoader workers"
NOT_ON_THREADS = (
    "the dataset draws from the global RNGs (random, numpy, torch), which threads share, and seeds were set "
    "(a generator given, or torch.manual_seed) so its draws must repeat on every run"
)
"""Why ``num_workers="auto"`` makes no batch on threads, in ``loader.stats()``."""


class WorkerIterator(
    LoaderNext, BudgetedWorkers, ReplicaStarts, FirstBatches, torch_dataloader._BaseDataLoaderIter
):
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
        self._factor = self._asked_factor = loader.prefetch_factor or 2
        self._tp_state = state = vars(loader)["_tp"]
        iterable = self._dataset_kind == torch_dataloader._DatasetKind.Iterable
        self._auto = state.workers_auto and not iterable
        most = self._plan_workers(loader, state, iterable)
        # what the autotuner and stats() see: this iterator's answers, held weakly (the tuner's
        # thread must not keep a dropped iterator, and its workers, alive)
        self._stage = WeakStage(STAGE, POOL, self)
        self._executors: AutoStage | None = None  # "auto": where batches are made, and the moves
        self._recycled: RecycledStack | None = None  # "auto": the memory of batches made here
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

    def _plan_workers(self, loader: DataLoader, state: Any, iterable: bool) -> int:
        """The most workers (or replicas) batches may be made on, returned, and what they need:
        the fetch task, the RAM budget and the worker processes (not started yet)."""
        most = (
            max(self._num_workers, 2 * usable_cpu_count())
            if state.workers_auto
            else self._num_workers
        )
        most = self._plan_replicas(state, iterable, most)
        processes = self._plan.processes if self._plan is not None else self._num_workers
        # "auto": the zygote is forked when batches first go to processes (the first decision is
        # made before the tuner's thread starts), not for an epoch that makes them here (its fork
        # and stop took ~10 ms, its memory the epoch)
        self._task = FetchTask(loader, int(self._base_seed), most, self._auto)
        self._take_budget(state, most)
        self._pool = self._new_pool(
            self._task, 0 if self._auto else processes, fork_now=not self._auto
        )
        return most

    def _plan_replicas(self, state: Any, iterable: bool, most: int) -> int:
        """``"auto"`` over an IterableDataset: ``most`` replicas (or what an earlier epoch
        decided), on processes decided from the first batches. Returns the replicas (else ``most``)."""
        self._plan: ReplicaPlan | None = None
        if state.workers_auto and iterable:
            most = state.replicas or most
            self._plan = ReplicaPlan(
                most, self._num_workers, state.tuned_workers, fixed=state.replicas is not None
            )
        self._held = deque()  # the plan's first batches
        self._before_start_over = None  # the replicas an epoch had before it started over
        return most

    def _take_budget(self, state: Any, most: int) -> None:
        """The RAM budget the loader keeps across epochs: the user's, else a share of what was
        available at the first epoch; a budget the user gave keeps the rings small."""
        self._options, given = state.autotune, state.autotune.ram_budget
        if state.memory is None:
            state.memory = LoaderMemory(
                default_budget() if given is None else given, given is not None
            )
        self._memory = state.memory
        lean = given is not None and state.workers_auto
        self._ring_limit = (
            ring_limit(given, min(most, usable_cpu_count())) if lean else MAX_RING_BYTES
        )

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
            pages_back=self._pages_back,
            parks=self._parks,
            memory=memory,
        )
        self._dispatch, self._placement = self._executors.dispatcher, self._executors.placement
        self._most_workers = most  # the knob's maximum, but on processes (_moved)
        self._knob = self._executors.add_knob(0, 0, most, apply=weakly(self.resize))

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

    @property
    def stage(self) -> WeakStage:
        """The workers' stage as the autotuner and ``stats()`` see it: a seam for tests that
        look at its knobs and counters."""
        return self._stage

    @property
    def placement(self) -> Placement | None:
        """Where batches are made and what moves them (``num_workers="auto"``; None for a fixed
        count), as the map stage's: a seam for tests that force a move."""
        return self._placement

    @property
    def process_pool(self) -> ProcessPool:
        """The worker processes' pool (parked, with no worker, while batches are made here), as
        the map stage's: a seam for tests that look at its worker processes."""
        return self._pool

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
            pool_holdings(self._pool, lambda: held_here(here)), id(self._pool)
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
        # batches drawn and numbered ahead for the first measurement's head start, not yet sent
        self._ahead: deque[Call] = deque()
        self._head: HeadStart | None = None
        if self._placement is not None:
            self._place()
        self._fill()

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
        if self._dispatch.draining and not self._parks():
            return  # under a budget that binds, two executors never hold their memory at once
        while (
            self._dispatch.pending < self._window()
            and (self._ahead or not self._sampler_done)
            and (self._auto or any(self._active))
        ):
            if self._ahead:  # drawn ahead for the first measurement (auto: never pinned)
                self._dispatch.submit(*self._ahead.popleft())
                continue
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

    def skip(self, count: int) -> None:
        """Resume support: drop ``count`` batches (map-style: drawn from the sampler, not fetched)."""
        for _ in range(count):
            if (
                self._dataset_kind == torch_dataloader._DatasetKind.Map
                and not self._dispatch.pending
                and not self._ahead
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

    def _fetch_here(self, executors: AutoStage) -> Any:
        """The next batch, made on this thread (inline, nothing in flight): no dispatch needed."""
        call = self._numbered()
        if call is None:
            self._shutdown_if_done()
            raise StopIteration
        return executors.call_here(*call)

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

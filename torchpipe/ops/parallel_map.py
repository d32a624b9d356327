"""The parallel ``map`` iterator: calls inline, on threads or in worker processes, in input order.

Ordering, bounded waits and the stall check are the runtime's
(:class:`~torchpipe.runtime.dispatch.Dispatcher`); where calls run, with ``executor="auto"``, is
the runtime's policy, and the executors, their moves and the autotuner's knob are built by the
runtime's one builder of such a stage (:class:`~torchpipe.runtime.placement.auto_stage.AutoStage`,
docs/executors.md). What is left here is the op: pulling and numbering input elements, the
checkpoint, and the pools its calls may need (worker processes, Ray actors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torchpipe.core.iterator import Iterator
from torchpipe.core.position_log import PositionLog
from torchpipe.core.tunable import POOL, Tunable
from torchpipe.ops.filter import DROPPED
from torchpipe.randomness import global_rng_states, restore_global_rng_states
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.executor import Executor
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.auto_stage import AutoStage, StageCalls, pass_candidates
from torchpipe.runtime.placement.costs import (
    INLINE,
    MAX_THREADS,
    PROCESS,
    RAY,
    THREAD,
    CallCosts,
    most_processes,
)
from torchpipe.runtime.placement.measure import measure_calls
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.placement.policy import Policy
from torchpipe.runtime.processes.pool import ProcessPool, process_executor_supported
from torchpipe.runtime.recycle import RecycledStack
from torchpipe.runtime.sizes import element_bytes
from torchpipe.runtime.timing import CallTiming

AUTO = "auto"
IN_FLIGHT = 2
"""Tasks each worker process keeps in flight to start with, and at least (torch's
``prefetch_factor`` default: one running, one waiting, so a worker never waits for the main
process, which may be busy with the training step, between two). Each is a slot of the worker's
ring, so this is also the memory a worker holds."""
LARGE_RESULT_BYTES = 4 << 20
"""From this size on, a result held by the consumer below a prefetch counts as a task in flight
too, and a worker's ring has no slot for it (see :meth:`ParallelMapIterator.count_held_above`):
a slot that large is worth more than the task it costs, whose round trip (0.1-0.2 ms) is small
beside writing such a result; smaller ones keep the slot and the task (rows of 4 KB on 2
processes lost 10% of their batches a second without it)."""
MOST_IN_FLIGHT = 4
"""The most the autotuner may raise it to (``num_parallel_calls=AUTOTUNE``), where its model says
the consumer waits for lack of them and the RAM budget holds them."""


NOT_ON_THREADS = (
    "the function draws from the global RNGs (random, numpy, torch), which threads share, and its "
    "draws must repeat on every run (deterministic, with seeds set)"
)
"""Why ``executor="auto"`` runs no call on threads, in ``stats()``."""
_DISPATCHED = object()
"""What :meth:`ParallelMapIterator._next_here` returns where the dispatcher's path must go on."""


class ParallelMapIterator(Iterator, Tunable):
    """Keeps calls in flight on the executor its placement chose, delivering results in order.

    Input elements are pulled on the consumer's thread and numbered; results are delivered in
    that order, or as they complete when not deterministic. The checkpoint is the input's
    position before the oldest undelivered element (see ``PositionLog``); in-flight calls are
    recomputed on resume.

    Args:
        name: the stage name.
        source: the input iterator.
        tasks: the call as it runs ``inline`` (as a worker would: global RNGs seeded per element
            where the pipeline has a seed), on a ``thread`` and in a ``process``.
        parallelism: threads or processes to start with (an explicit ``num_parallel_calls``).
        deterministic: deliver in input order.
        executor: ``"thread"``, ``"process"``, a ``tp.RayExecutor`` (Ray actors: it makes the
            pool, ``runtime/ray/pool.py``), or ``"auto"`` (the policy chooses, and moves the calls
            while they run; with ``tunable`` inline is a candidate too).
        restart: replace dead worker processes.
        tunable: ``num_parallel_calls=AUTOTUNE``: the autotuner resizes the pool while it runs.
        learned: what earlier passes of the Dataset settled on; updated by this one.
        stall_s: ``Options.stall_timeout``.
        reproducible_globals: calls must draw the same numbers from the global RNGs on every run
            (the pipeline has a seed): threads, which share those RNGs, are then a candidate only
            for calls that do not draw from them.
        memory: where the calls made in this process (inline, threads) stack their batches: it
            keeps freed batches' buffers only while they run here.
    """

    tuning_role = POOL

    def __init__(
        self,
        name: str,
        source: Iterator,
        *,
        tasks: dict[str, Callable[[int, Any], Any]],
        parallelism: int,
        deterministic: bool,
        executor: Any,
        restart: bool,
        tunable: bool = False,
        learned: dict[str, Any] | None = None,
        stall_s: float | None = None,
        reproducible_globals: bool = False,
        memory: RecycledStack | None = None,
    ) -> None:
        super().__init__(name, source)
        self._memory = memory
        self._learned = learned if learned is not None else {}
        self.stats.calls = CallTiming()
        self._log = PositionLog(source)
        self._tasks = tasks
        self._deterministic = deterministic
        self._restart = restart
        self._reproducible = reproducible_globals
        self._exhausted = False
        self._started = False
        self._pool: ProcessPool | None = None
        self._ray: Any = None  # a tp.RayExecutor (Ray is imported only when it makes its pool)
        self._ray_pool: Any = None
        processes = self._take_executor(executor)
        self._parallelism = (
            self._learned.get("parallelism", parallelism) if tunable else parallelism
        )
        self._policy = self._new_policy(tunable, processes) if self._fixed is None else None
        self._executors = self._new_stage(name, self.stats.calls, stall_s)
        self._dispatch, self._placement = self._executors.dispatcher, self._executors.placement
        self._knob = self._add_knob() if tunable else None
        self._in_flight, self._in_flight_knob = self._tasks_in_flight(tunable)
        self._held_above: Callable[[], int] | None = None
        self._consumers = 0  # the consumer's result, counted in flight (large results only)

    def count_held_above(self, held: Callable[[], int]) -> None:
        """Count ``held()`` results, delivered to the buffer right above (a prefetch's) and kept
        there, as tasks in flight while the calls run in worker processes.

        There each result is a record of a worker's ring, which has a slot for each task in
        flight and one for the result the consumer holds: a buffer that kept more made the
        rings add slots (or send one-off segments), and the tree held a buffer's worth of
        batches more than torch's DataLoader, which keeps ``prefetch_factor`` batches a worker
        and the one the user holds. Counted, the buffer is part of the map's window: results
        wait there instead of here, and the workers run ahead by what is left of it (one task
        at least, so that the pass goes on). Where the results are large
        (:data:`LARGE_RESULT_BYTES`) the one the consumer holds counts too, and the rings drop
        the slot they kept for it: torch's DataLoader's memory, its workers' ``prefetch_factor``
        batches and the user's one, with no slot more that the rings would go round through."""
        self._held_above = held

    def _count_the_consumers(self, value: Any) -> None:
        """The first large result (sampled) while a buffer above counts: the consumer's too."""
        pool = self._pool
        if pool is None or self._placement.kind != PROCESS:
            return
        if element_bytes(value) >= LARGE_RESULT_BYTES:
            self._consumers = 1
            pool.set_held(0)

    def _room(self) -> bool:
        """Whether another task may be submitted (see :meth:`count_held_above`)."""
        dispatch = self._dispatch
        if not dispatch.has_room():
            return False
        if self._held_above is None or self._placement.kind != PROCESS or not dispatch.pending:
            return True
        held = self._held_above() + self._consumers
        return dispatch.pending + held < dispatch.executor.capacity

    def _take_executor(self, executor: Any) -> bool:
        """Where the calls run: fixed by ``executor`` (a tp.RayExecutor's actors, which build
        their pool, importing Ray then; threads for processes where the system cannot fork them),
        or the policy's choice (``"auto"``). Returns whether worker processes can run calls here."""
        if getattr(executor, "kind", None) == RAY:
            self._ray, executor = executor, RAY
        processes = process_executor_supported()
        if executor == PROCESS and not processes:
            executor = THREAD
        self._fixed = executor if executor != AUTO else None
        return processes

    def _new_stage(self, name: str, timing: CallTiming, stall_s: float | None) -> AutoStage:
        """The runtime's auto stage for the calls (timed in ``timing``): their executors (Ray
        actors where a tp.RayExecutor asked for them), the dispatcher, the placement and its moves."""
        ray = self._ray_actors if self._ray is not None else None
        calls = StageCalls(
            self._tasks[INLINE], self._tasks[THREAD], processes=self._processes, ray=ray
        )
        return AutoStage(
            name,
            calls,
            timing,
            self._policy,
            learned=self._learned,
            stall_s=stall_s,
            on_move=self._moved,
            memory=self._memory,
        )

    def _add_knob(self) -> LiveKnob:
        """``num_parallel_calls=AUTOTUNE``: the autotuner's knob, from 0 (inline) where the policy
        may run calls inline, as many actors as the Ray executor allows, else 1."""
        lowest = 0 if self._policy is not None and INLINE in self._policy.candidates else 1
        if self._ray is not None:
            lowest = self._ray.min_actors
            self._parallelism = max(
                lowest, min(self._parallelism, self._ray.max_actors or self._parallelism)
            )
        return self._executors.add_knob(
            self._parallelism, lowest, self._most(RAY if self._ray is not None else THREAD)
        )

    def _tasks_in_flight(self, tunable: bool) -> tuple[int, LiveKnob | None]:
        """Tasks a worker process keeps in flight, and the autotuner's knob for them where it has one."""
        if not tunable:
            return IN_FLIGHT, None
        tasks = self._learned.get("in_flight", IN_FLIGHT)
        return tasks, LiveKnob(
            f"{self.name}.in_flight", tasks, IN_FLIGHT, MOST_IN_FLIGHT, True, self._set_in_flight
        )

    def _new_policy(self, tunable: bool, processes: bool) -> Policy:
        """``executor="auto"``: the policy, choosing from what the earlier passes left worth trying
        (inline too where the autotuner may ask for it)."""
        learned, cores = self._learned, usable_cpu_count()
        candidates = pass_candidates(
            inline=tunable,
            processes=processes,
            last=learned.get("executor"),
            costs=learned.get("costs"),
            measured=learned.get("measured", {}),
            cores=cores,
        )
        return Policy(candidates, cores)

    @property
    def kept_bytes(self) -> int:
        """Bytes this process keeps to stack the next batches made here in (0 where none are, or
        once the calls went to worker processes): a seam for tests, as the DataLoader's."""
        return self._memory.free_bytes if self._memory is not None else 0

    @property
    def executor_kind(self) -> str:
        """``inline``, ``thread`` or ``process`` once chosen; ``auto`` before the first element."""
        return self._placement.kind if self._started else (self._fixed or AUTO)

    @property
    def placement(self) -> Placement:
        """Where the calls run and what moves them (a fixed executor's has no policy): a seam
        for tests that force a move, as the policy's verdicts and the autotuner do."""
        return self._placement

    @property
    def process_pool(self) -> ProcessPool | None:
        """The stage's process pool, where it made one (None before, and once closed): a seam for
        tests that look at its worker processes."""
        return self._pool

    def knobs(self) -> list[LiveKnob]:
        if self._knob is not None and self._ray_pool is not None:  # the cluster's free CPUs move
            self._knob.maximum = max(self._ray_pool.most_actors(), self._knob.minimum)
        knobs = [self._knob] if self._knob is not None else []
        if self._in_flight_knob is not None and self._started and self._placement.kind == PROCESS:
            knobs.append(self._in_flight_knob)  # only worker processes keep tasks in flight each
        return knobs

    def _set_in_flight(self, tasks: int) -> None:
        """The autotuner's tasks in flight per worker process (their ring follows), kept for the
        next pass."""
        self._in_flight = self._learned["in_flight"] = tasks
        if self._pool is not None:
            self._pool.set_per_worker(tasks)

    def parallelism(self) -> int:
        return self._placement.workers if self._started else self._parallelism

    def buffer_slots(self) -> int:
        return self._dispatch.executor.capacity

    def calls_in_processes(self) -> bool:
        return self._placement.kind in (PROCESS, RAY)

    def calls_on_cluster(self) -> bool:
        """Whether calls run on Ray actors, whose CPUs are the cluster's, not this machine's."""
        return self._placement.kind == RAY

    def executor_report(self) -> dict[str, Any]:
        """Where the calls run, for ``it.stats()``: the ``executor`` kind, its ``workers`` (threads,
        processes or actors; 0 inline), the worker processes' ``pids`` where it may fork them
        (attach a profiler to one), Ray's actors and transfers, and, with ``executor="auto"``, what
        its policy measured (``policy``: :meth:`~torchpipe.runtime.placement.policy.Policy.report`)."""
        report: dict[str, Any] = {"executor": self.executor_kind, "workers": self.parallelism()}
        if self._pool is not None:
            report["pids"] = self._pool.pids
        if self._ray_pool is not None:
            report["ray"] = self._ray_pool.report()
        report.update(self._executors.policy_report(NOT_ON_THREADS))
        return report

    def prepare(self) -> None:
        super().prepare()
        wants_processes = self._fixed == PROCESS or (
            self._policy is not None and PROCESS in self._policy.candidates
        )
        if wants_processes and self._pool is None:
            # executor="process" forks the zygote now, before any thread runs; "auto" when calls
            # first go to processes, as tp.DataLoader("auto") does (a pass that runs them here
            # or on threads forked it for nothing: ~6 ms, and as much again to stop it)
            self._pool = ProcessPool(
                self._tasks[PROCESS],
                self._parallelism,
                self.name,
                restart=self._restart,
                timing=self.stats.calls,
                fork_now=self._fixed == PROCESS,
                per_worker=self._in_flight,
            )

    def start(self) -> None:
        self._started = True
        if self._fixed is not None:
            self._placement.move(self._fixed, self._parallelism)
        # else: an earlier pass measured
        elif not self._placement.resume(self._learned, self._parallelism):
            self._placement.decide(self._measure())

    def _measure(self) -> CallCosts:
        """The first calls, run inline under the policy's measurements; their results are
        delivered in their places. The caller's global RNG states are put back afterwards (the
        calls seed them as a worker would)."""
        drew = []
        saved = global_rng_states()
        try:
            costs, _ = measure_calls(
                self._run_inline, on_draws=lambda draws: drew.append(draws.drew)
            )
        finally:
            restore_global_rng_states(saved)
        # the user fixed how many calls run at once: the choice is made at that many
        if self._knob is None:
            costs = dataclasses.replace(costs, most=self._parallelism)
        return costs.without_threads() if self._reproducible and any(drew) else costs

    def _run_inline(self, limit: int) -> list[Any]:
        return self._executors.run_inline(limit, self._next_call)

    def _next_call(self) -> tuple[int, Any] | None:
        """The next input element as a numbered call; None at the input's end (an input error on
        the way is delivered in its place)."""
        while not self._exhausted:
            seq, payload = self._pull()
            if seq is not None:
                return seq, payload
        return None

    def _processes(self, workers: int) -> Executor:
        """The worker processes with ``workers`` of them (forking the zygote the first time)."""
        self.prepare()
        assert self._pool is not None  # made by prepare()
        self._pool.resize(workers)
        return self._pool

    def _ray_actors(self, workers: int) -> Executor:
        if self._ray_pool is None:
            self._ray_pool = self._ray.pool(
                self._tasks[RAY], workers, self.name, restart=self._restart, timing=self.stats.calls
            )
        else:
            self._ray_pool.resize(workers)
        return self._ray_pool

    def _most(self, kind: str) -> int:
        """The most calls in flight the autotuner may ask for: processes one a core for calls
        that compute, twice the cores for calls that wait (:func:`most_processes`); threads wait
        on I/O; actors as many as the cluster's free CPUs allow."""
        if kind == RAY:
            return self._ray_pool.most_actors() if self._ray_pool is not None else self._parallelism
        if kind != PROCESS:
            return MAX_THREADS
        return most_processes(self._policy.costs if self._policy else None, usable_cpu_count())

    def _moved(self, kind: str, workers: int) -> None:
        self._placement.remember(self._learned)
        if workers:
            self._parallelism = workers
            self._learned["parallelism"] = workers
        if self._knob is not None:  # its value follows the move (AutoStage)
            self._knob.maximum = max(self._most(kind), workers)

    def _pull(self) -> tuple[int | None, Any]:
        """Pull and number one input element; an input error is delivered as its result."""
        try:
            seq, element, error = self._log.pull()
        except StopIteration:
            self._exhausted = True
            return None, None
        if error is not None:
            self._dispatch.put(seq, None, error)
            return None, None
        return seq, element

    def _fill(self) -> None:
        while not self._exhausted and self._room():
            seq, payload = self._pull()
            if seq is not None:
                self._dispatch.submit(seq, payload)

    def next(self) -> Any:
        if self._knob is not None:
            self._knob.take_request()
        if self._in_flight_knob is not None:
            self._in_flight_knob.take_request()
        dispatch = self._dispatch
        if self._executors.runs_here():
            value = self._next_here()
            if value is not _DISPATCHED:
                return value
        while True:
            self._fill()
            if not dispatch.pending:
                self._placement.finish(self.stats.wall_s)
                self._placement.remember(self._learned)  # what this pass's last window measured
                self._end_of_pass()
                raise StopIteration
            waited = dispatch.wait_s
            seq, value, error = dispatch.take(self._deterministic)
            self.stats.wait_s += dispatch.wait_s - waited
            self.stats.look(dispatch.finished, dispatch.executor.capacity)
            self._log.delivered(seq)
            self._placement.delivered(self.stats.wall_s)
            if error is not None:
                raise error
            if value is not DROPPED:  # a fused filter said no
                sampled = self.stats.sample_bytes(value)
                if sampled and self._held_above is not None and not self._consumers:
                    self._count_the_consumers(value)
                return value

    def _next_here(self) -> Any:
        """The next result, made on this thread (inline, nothing in flight: no dispatch needed);
        :data:`_DISPATCHED` where the input ended or failed (the dispatcher's path delivers that)."""
        while True:
            seq, payload = self._pull()
            if seq is None:
                return _DISPATCHED
            try:
                value = self._executors.call_here(seq, payload)
            finally:
                self.stats.look(0, 1)
                self._log.delivered(seq)
                self._placement.delivered(self.stats.wall_s)
            if value is not DROPPED:  # a fused filter said no
                self.stats.sample_bytes(value)
                return value

    def _end_of_pass(self) -> None:
        """Give Ray actors back now, not when the iterator is closed: they hold the cluster's CPUs,
        which the next pass (or another pipeline) needs, and they stay warm for it a while."""
        if self._ray_pool is not None and self._dispatch.executor is self._ray_pool:
            self._ray_pool.resize(0)

    def get_state(self) -> dict[str, Any]:
        return self._log.state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._log.set_state(state, self.name)

    def shutdown(self) -> None:
        self._dispatch.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._ray_pool is not None:
            self._ray_pool.close()  # its actors stay warm a few seconds for the next pass
            self._ray_pool = None

"""The one builder of a stage whose calls the policy places: map's calls and the DataLoader's batches.

A stage says what its call is on each kind of executor (:class:`StageCalls`); :class:`AutoStage`
builds the rest of what ``executor="auto"`` (and ``num_workers="auto"``) needs: the
:class:`~torchpipe.runtime.dispatch.Dispatcher` its tasks go through, the
:class:`~torchpipe.runtime.placement.placement.Placement` that moves them, the autotuner's knob for
how many run at once, and the making and retiring of executors as the calls move.
:func:`pass_candidates` says which executors a pass may choose from. A fixed executor is a
placement whose policy is None: it is moved to once and stays.

An interleave's readers are not built here: they are not calls under a dispatcher but open inner
iterators, which move with what they read between two reader pools
(:class:`~torchpipe.ops.interleave.placement.ReaderPlacement`, on the same driver and policy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.executor import Executor, InlineExecutor, ThreadExecutor
from torchpipe.runtime.heap import trim_heap
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.costs import INLINE, PROCESS, RAY, THREAD, CallCosts
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.placement.policy import Policy, may_pay
from torchpipe.runtime.recycle import RecycledStack
from torchpipe.runtime.timing import CallTiming

Handler = Callable[[int, Any], Any]
"""``handler(seq, payload) -> value``: one call of a stage."""
PoolOf = Callable[[int], Executor]
"""``pool(workers)``: a stage's pool of ``workers`` processes (or actors), made when first asked for."""


@dataclasses.dataclass(frozen=True)
class StageCalls:
    """One stage's call on each kind of executor.

    Attributes:
        inline: the call as it runs on the consumer's thread.
        thread: the call as it runs on a pool thread (threads share the global RNGs: it may seed
            fewer of them).
        processes: the stage's process pool with the given number of worker processes; None
            where the stage has none.
        ray: the stage's Ray actor pool with the given number of actors; None where it has none.
    """

    inline: Handler
    thread: Handler
    processes: PoolOf | None = None
    ray: PoolOf | None = None


def pass_candidates(
    *,
    inline: bool,
    processes: bool,
    last: str | None,
    costs: CallCosts | None,
    measured: dict[str, float],
    cores: int,
) -> tuple[str, ...]:
    """The executors a stage's pass may place its calls on.

    Inline where the stage may run them on the consumer's thread, threads always, and worker
    processes where they can fork and may pay (:func:`~torchpipe.runtime.placement.policy.may_pay`,
    from what the earlier passes learned: the executor they ``last`` ran on, the calls' ``costs``
    and the times ``measured``): a pass without them forks no zygote.
    """
    pays = processes and may_pay(PROCESS, last, costs, measured, cores)
    return ((INLINE,) if inline else ()) + ((THREAD, PROCESS) if pays else (THREAD,))


class AutoStage:
    """The executors one stage's calls run on, as its policy places them.

    It holds the stage's :attr:`dispatcher` (its first executor: inline), its :attr:`placement`
    (moved by the policy's verdicts, the autotuner's knob, or once to a fixed executor) and,
    once :meth:`add_knob` made it, the autotuner's :attr:`knob`, which follows every move.

    Args:
        name: the stage name (errors, threads' names, the knob's name).
        calls: the stage's call on each kind of executor.
        timing: the stage's call timing (every executor adds to it).
        policy: decides where calls run; None for a fixed executor.
        learned: what the stage's passes learned (the placement's windows go on from it).
        stall_s: the dispatcher's stall limit (``Options.stall_timeout``).
        on_move: called with ``(kind, workers)`` after every move, once the knob follows it.
        pages_back: whether the parked pool's slots may keep their pages again when the calls
            come back to it (default: always; a loader's RAM budget may have released them).
        parks: whether the pool keeps its workers up while a trial runs elsewhere (default:
            always; not where a loader's RAM budget binds).
        memory: where the calls made in this process stack their batches: it keeps the buffers
            of freed batches only while the calls run here.
    """

    def __init__(
        self,
        name: str,
        calls: StageCalls,
        timing: CallTiming,
        policy: Policy | None,
        *,
        learned: dict[str, Any] | None = None,
        stall_s: float | None = None,
        on_move: Callable[[str, int], None] | None = None,
        pages_back: Callable[[], bool] | None = None,
        parks: Callable[[], bool] | None = None,
        memory: RecycledStack | None = None,
    ) -> None:
        self.name = name
        self._memory = memory
        self.policy = policy
        self.knob: LiveKnob | None = None
        self._calls = calls
        self._timing = timing
        self._on_move = on_move
        # the process pool made: parked, not closed, when the calls leave
        self._processes: Executor | None = None
        # the parked pool keeps its workers until a window away from it is judged
        self._warm = False
        self._pages_back = pages_back
        self._parks = parks
        # the parked pool's slots gave their pages back when the calls left it (_park_pages)
        self._parked_released = False
        self._trim_when_settled = False  # heap to give back once the results in flight are out
        self._threads = 0  # the threads the calls run on (0: not on threads)
        self.dispatcher = Dispatcher(name, self.make(INLINE, 0), stall_s)
        self.placement = Placement(
            self.dispatcher,
            self.make,
            policy,
            timing,
            self._moved,
            self.retire,
            learned,
            on_stay=self.settled,
        )

    def add_knob(
        self, value: int, lowest: int, most: int, apply: Callable[[int], None] | None = None
    ) -> LiveKnob:
        """The autotuner's knob for how many calls run at once (0: inline), from ``lowest`` to
        ``most``, named ``<stage>.parallelism``; its value follows every move.

        Args:
            apply: what the tuner's request does (default: the placement's ``resize``); a stage
                whose tuner must not keep it alive passes one that holds it weakly.
        """
        self.knob = LiveKnob(
            f"{self.name}.parallelism", value, lowest, most, False, apply or self.placement.resize
        )
        return self.knob

    @property
    def kind(self) -> str:
        """Where calls run now: ``inline``, ``thread``, ``process`` or ``ray``."""
        return self.placement.kind

    @property
    def workers(self) -> int:
        """The threads, processes or actors calls run on now (0 inline)."""
        return self.placement.workers

    def runs_here(self) -> bool:
        """Whether the next call may run on this thread with no dispatch: inline, nothing in flight."""
        return self.placement.kind == INLINE and not self.dispatcher.pending

    def call_here(self, seq: int, payload: Any) -> Any:
        """Run call ``seq`` now on this thread (where :meth:`runs_here`), timed like every call;
        its exception propagates."""
        return cast(InlineExecutor, self.dispatcher.executor).call(seq, payload)

    def run_inline(
        self,
        limit: int,
        next_call: Callable[[], tuple[int, Any] | None],
        call: Handler | None = None,
    ) -> list[Any]:
        """Run up to ``limit`` calls on this thread (what the policy's first measurement times),
        each delivered in its place through the dispatcher, a failed one as its exception.

        Args:
            limit: the most calls to run.
            next_call: the next call's ``(seq, payload)``, None where there is none.
            call: the call to run (default: the stage's inline call).

        Returns:
            The values, None for a call that raised.
        """
        call = call or self._calls.inline
        results: list[Any] = []
        while len(results) < limit and (task := next_call()) is not None:
            seq, payload = task
            try:
                value, error = call(seq, payload), None
            except Exception as e:  # noqa: BLE001 - delivered in its place, like a worker's
                value, error = None, e
            self.dispatcher.put(seq, value, error)
            results.append(value)
        return results

    def policy_report(self, not_on_threads: str) -> dict[str, Any]:
        """What the policy measured, for ``stats()``: the executors it ``measured``, its ``policy``
        report (:meth:`~torchpipe.runtime.placement.policy.Policy.report`), the most worker
        processes the calls ran on at once over every pass (``most_processes``: a trial counts),
        and, where the calls may not run on threads, ``not_on_threads``: why. Nothing for a fixed
        executor."""
        policy = self.policy
        if policy is None:
            return {}
        report: dict[str, Any] = {
            "measured": sorted(policy.measured),
            "policy": policy.report(),
            "most_processes": self.placement.most_processes,
        }
        if policy.costs is not None and not policy.costs.thread_safe:
            report["not_on_threads"] = not_on_threads
        return report

    def make(self, kind: str, workers: int) -> Executor:
        """The stage's executor of ``kind`` with ``workers`` threads, processes or actors.

        Raises:
            ValueError: for a kind the stage has no executor of.
        """
        if kind == INLINE:
            self._keep_memory(True, most=1)  # one batch at a time: the loop's and the next
            return InlineExecutor(self._calls.inline, self._timing)
        if kind == THREAD:
            self._keep_memory(True)
            return ThreadExecutor(self._calls.thread, workers, self.name, self._timing)
        pool = {PROCESS: self._calls.processes, RAY: self._calls.ray}.get(kind)
        if pool is None:
            raise ValueError(f"{self.name}: no {kind!r} executor for this stage's calls")
        # before a zygote is forked (the first, or a new one once the last went): it would copy
        # the buffers kept here and the heap the calls made here left free (the threads' arenas)
        if self._memory is not None:
            self._memory.keep_freed(False)
        trim_heap()
        executor = pool(workers)
        if kind == PROCESS:
            self._processes, self._warm = executor, False
        return executor

    def retire(self, executor: Executor) -> None:
        """What becomes of an executor the calls left, once its tasks are done: the process pool
        is parked with its workers up, so that calls coming back after a window elsewhere (the
        policy trying threads) fork nothing, unless they left it for an executor measured faster
        (its workers and zygote go then, not a window later) or a RAM budget binds (``parks``
        says no: its workers go, their heaps would peak with the trial's memory; the zygote
        stays to fork them again); any other is closed. Threads
        left, or calls gone out of this process, leave heap behind that nothing here reuses (the
        threads' arenas, the inline calls' freed elements): it is given back to the system
        (``malloc_trim``), so that it does not peak with the memory of the executor the calls
        went to."""
        if executor is self._processes:
            if self._processes_lost():
                self.let_go(executor)
            elif self._parks is not None and not self._parks():
                executor.resize(0)
            else:
                self._warm = True
            return
        executor.close()
        now = self.dispatcher.executor
        here = now is not self._processes and isinstance(now, (InlineExecutor, ThreadExecutor))
        if isinstance(executor, ThreadExecutor) or not here:
            trim_heap()
            # the results made there that were in flight are freed once delivered: again then
            self._trim_when_settled = True

    def settled(self) -> None:
        """A window kept the calls where they are: the heap the executor (or the threads) left
        gave back again (its last results were delivered since, and freed), and, away from the
        parked pool, its workers go, and its zygote with them: it holds its own copies of every
        page this process rewrote since the fork (``tfrecord``: 20-100 MB; torch's DataLoader
        with no workers holds none), and a pool that needs workers again forks a new one (a
        ``fork`` of this process, ~10 ms, as ``executor="auto"`` forks its first)."""
        if self._trim_when_settled:
            self._trim_when_settled = False
            trim_heap()
        if self._warm and self._processes is not None and self.placement.kind != PROCESS:
            self._warm = False
            self.let_go(self._processes)

    def _processes_lost(self) -> bool:
        """Whether the calls left the process pool for an executor measured faster lately (not a
        trial of another, which the calls may come back from at once: the pool is then parked)."""
        now = self.dispatcher.executor  # the placement's kind is set once the switch is done
        if now is self._processes or not isinstance(now, (InlineExecutor, ThreadExecutor)):
            return False
        policy, kind = self.policy, INLINE if isinstance(now, InlineExecutor) else THREAD
        if policy is None:
            return False
        measured = policy.measured
        return PROCESS in measured and kind in measured and measured[kind] < measured[PROCESS]

    @staticmethod
    def let_go(pool: Executor) -> None:
        """The pool's workers go, and its zygote (Ray's actors have none); asked for workers
        again, it forks a new one. (Also how a pool the calls never went to is retired: the
        DataLoader's head start, loader/head_start.py.)"""
        pool.resize(0)
        release = getattr(pool, "release_zygote", None)
        if release is not None:
            release()

    def _keep_memory(self, keep: bool, most: int | None = None) -> None:
        """Whether the buffers of batches made here are kept for the next ones, ``most`` of a size
        (None: as many as the pool keeps; only while the calls run here: else they go, and the
        heap they leave is given back)."""
        if self._memory is not None and self._memory.keep_freed(keep, most):
            trim_heap()

    def _park_pages(self, kind: str) -> None:
        """Away from the process pool, its parked workers' slots give their pages back as their
        results are released (and the workers their free heap): a trial elsewhere would
        otherwise hold its own results on top of the parked rings'. Back on the pool, the slots
        keep their pages again (no page faults a result), unless ``pages_back`` says no."""
        pool: Any = self._processes  # a ProcessPool, or Ray's actors (no rings)
        if pool is None or not hasattr(pool, "set_slot_pages"):  # Ray actors hold no rings
            return
        if kind == PROCESS:
            if self._parked_released and (self._pages_back is None or self._pages_back()):
                pool.set_slot_pages(True)
            self._parked_released = False
        elif not self._parked_released and pool.slot_pages:
            pool.set_slot_pages(False)
            self._parked_released = True

    def _moved(self, kind: str, workers: int) -> None:
        self._park_pages(kind)
        if kind == THREAD and workers < self._threads:
            # threads that exit leave their arenas' free memory behind (glibc keeps up to twice
            # the largest block it mapped free in each: ~20 MB a thread on tfrecord), which the
            # threads left reuse only in part: given back once their last results are delivered
            self._trim_when_settled = True
        self._threads = workers if kind == THREAD else 0
        if self.knob is not None:
            self.knob.moved(workers)
        if self._on_move is not None:
            self._on_move(kind, workers)

"""Where one stage's calls run, chosen by the policy and moved while the stage runs.

A :class:`Placement` is what map and the DataLoader share for ``executor="auto"``
(and ``num_workers="auto"``): it takes the first calls' costs, measured inline
(:func:`~torchpipe.runtime.placement.measure.measure_calls`), asks the
:class:`~torchpipe.runtime.placement.policy.Policy` where they should run, puts that executor under
the stage's :class:`~torchpipe.runtime.dispatch.Dispatcher`, and after every window of delivered
elements (the windows are the :class:`~torchpipe.runtime.placement.driver.MoveDriver`'s) reports
what the consumer got, moving the calls when the policy says so. A move never loses, repeats or
reorders an element: tasks in flight finish where they are, and results keep their sequence numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, cast

from torchpipe.runtime.cpu import grown, run_delay
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.executor import Executor
from torchpipe.runtime.placement.costs import (
    INLINE,
    PROCESS,
    THREAD,
    CallCosts,
    cost_scale,
    observe_message_cost,
    transfer_seconds,
    workers,
)
from torchpipe.runtime.placement.driver import CALLS, LEAVE, REBASE, Cadence, MoveDriver
from torchpipe.runtime.placement.policy import Policy
from torchpipe.runtime.timing import CallTiming

MakeExecutor = Callable[[str, int], Executor]
"""``make(kind, workers)``: the stage's executor of ``kind`` with ``workers`` threads or processes."""


class Placement:
    """The executor one stage's calls run on, and the measurements that move them.

    Args:
        dispatcher: the stage's dispatcher (its executor is swapped on a move).
        make: builds the stage's executors.
        policy: decides where calls run; None for a stage whose executor is fixed.
        timing: the stage's call timing (every executor adds to it).
        on_move: called with ``(kind, workers)`` after every move (a knob follows it).
        retire: what to do with an executor the calls moved away from, once its tasks are done
            (default: close it; a process pool is parked instead, to come back to).
        learned: where the stage keeps what its passes learned: the windows' state is kept there,
            so the next pass (another ``Placement``) goes on judging where this one stopped.
        on_stay: called after a window whose verdict keeps the calls where they run.
    """

    _held: ClassVar[bool] = False  # within never_moving()

    @classmethod
    @contextlib.contextmanager
    def never_moving(cls) -> Iterator[None]:
        """A seam for tests and benchmarks: a stage whose first placement is made within the block
        acts on no window's verdict, then or in its later passes (none is ever agreed on): its
        calls stay where its first decision or an explicit :meth:`move` put them."""
        before, Placement._held = Placement._held, True
        try:
            yield
        finally:
            Placement._held = before

    def __init__(
        self,
        dispatcher: Dispatcher,
        make: MakeExecutor,
        policy: Policy | None,
        timing: CallTiming,
        on_move: Callable[[str, int], None] | None = None,
        retire: Callable[[Executor], None] | None = None,
        learned: dict[str, Any] | None = None,
        on_stay: Callable[[], None] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.kind = INLINE
        self.workers = 0
        self._make = make
        self._timing = timing
        self._on_move = on_move
        self._on_stay = on_stay
        self._retire = retire
        # The windows go on from one pass to the next (an epoch may be shorter than a window).
        self._windows = learned if learned is not None else {}
        self._driver: MoveDriver = self._windows.setdefault("driver", MoveDriver(self._cadence()))
        self._windows.setdefault("delivered", 0)

    @classmethod
    def _cadence(cls) -> Cadence:
        """The windows of a placement made now (:data:`CALLS`, none agreed on where held)."""
        return dataclasses.replace(CALLS, agree=sys.maxsize) if cls._held else CALLS

    @property
    def _held_here(self) -> bool:
        """Whether this placement was made within :meth:`never_moving` (no verdict moves it)."""
        return self._driver.cadence.agree == sys.maxsize

    @property
    def _delivered(self) -> int:
        return cast(int, self._windows["delivered"])

    @property
    def most(self) -> int | None:
        """The most threads or processes any move may start (None: no cap; 0: calls run inline),
        kept from one pass to the next: a RAM budget's verdict."""
        return cast("int | None", self._windows.get("most"))

    @property
    def most_processes(self) -> int:
        """The most worker processes the calls ran on at once, over every pass so far (a trial's
        included): what the stage's memory was at most, counted as torch counts ``num_workers``."""
        return cast(int, self._windows.get("most_processes", 0))

    def cap(self, most: int) -> None:
        """From now on run calls on at most ``most`` threads or processes (0: inline)."""
        self._windows["most"] = most
        if self.workers > most:
            self.move(self.kind, most)

    def move(self, kind: str, count: int, again: bool = False) -> None:
        """Run new calls on ``kind`` with ``count`` threads or processes from now on (at most
        :attr:`most`). What is in flight, made where the calls ran before, is not judged, nor the
        first two results of each worker process or thread (their first calls are cold: a worker
        faults its ring in, a thread its batches' memory and its arena). ``again``: a new pass
        goes on where the last one ran its calls."""
        if self.most is not None:
            count = min(count, self.most)
            kind = INLINE if count < 1 else kind
        count = 0 if kind == INLINE else max(count, 1)
        if kind != self.kind:
            self.dispatcher.switch(self._make(kind, count), self._retire)
            self._windows.pop("inline_calls", None)  # the share is measured afresh
        elif count != self.workers:
            self.dispatcher.executor.resize(count)
        self.kind, self.workers = kind, count
        if kind == PROCESS and count > self.most_processes:
            self._windows["most_processes"] = count
        if self.policy is not None:
            self.policy.moved(kind)
        unjudged = self._driver.cadence.settle_elements + self.dispatcher.pending
        # a trial of threads judged on its cold start lost big to processes (#59: `bigtensor`'s
        # DataLoader faulted ~40k pages, four 38 MB batches, then) and was not tried again
        unjudged += 2 * count if kind in (PROCESS, THREAD) else 0
        self._driver.moved(kind, self._delivered + unjudged, time.perf_counter(), again)
        if self._on_move is not None:
            self._on_move(self.kind, self.workers)

    def stayed(self) -> None:
        """A window's verdict kept the calls where they run: the stage hears it (``on_stay``: it
        lets go of what the calls left). Also a seam for tests and benchmarks that hold the
        verdicts (:meth:`never_moving`) and play a window that keeps the calls."""
        if self._on_stay is not None:
            self._on_stay()

    def new_pass(self) -> None:
        """The stage starts another pass (an epoch) where the last one left its calls: the
        windows go on from the last pass's verdicts."""
        self._driver.new_pass(self._delivered)

    def finish(self, inside_s: float) -> None:
        """The pass ends (``inside_s`` as for :meth:`delivered`): its last window is judged
        however short it is, so an epoch shorter than a window still counts."""
        self._judge(inside_s, last=True)

    def decide(self, costs: CallCosts) -> None:
        """The first decision, from calls measured inline."""
        assert self.policy is not None  # only a stage with a policy decides
        kind = self.policy.decide(costs)
        self.move(kind, workers(costs, kind, self.policy.cores))

    def resume(self, learned: dict[str, Any], count: int) -> bool:
        """Start where an earlier pass left off (its executor, costs and measurements), with
        ``count`` threads or processes; False if nothing was learned."""
        kind, costs = learned.get("executor"), learned.get("costs")
        if self.policy is None or kind not in self.policy.candidates or costs is None:
            return False
        self.policy.restore(costs, learned.get("measured", {}), kind)
        self.move(kind, count, again=True)
        return True

    def remember(self, learned: dict[str, Any]) -> None:
        """Write what this pass knows into ``learned``, for the next pass to :meth:`resume`."""
        learned["executor"] = self.kind
        if self.policy is not None and self.policy.costs is not None:
            learned["costs"], learned["measured"] = self.policy.costs, self.policy.measured

    def resize(self, count: int) -> None:
        """The autotuner's request: ``0`` runs calls inline; more, on the best parallel executor."""
        if count == self.workers:
            return
        if count == 0:
            self.move(INLINE, 0)
        elif self.kind == INLINE:
            self.move(self.policy.alternative() if self.policy is not None else self.kind, count)
        else:
            self.move(self.kind, count)

    def delivered(self, inside_s: float) -> None:
        """Count one element handed to the consumer; ``inside_s`` is the stage's total time inside
        its ``next()`` so far in this pass (the rest is the consumer's). Every window the policy
        sees what the consumer got."""
        self._windows["delivered"] += 1
        self._judge(inside_s)

    def _judge(self, inside_s: float, last: bool = False) -> None:
        if self.policy is None:
            return
        delivered = self._delivered
        look = lambda: (delivered, inside_s, self._timing.totals(), run_delay())  # noqa: E731 - read only where a window starts or ends
        done = self._driver.window(
            time.perf_counter(), delivered, look, last=last, slower_than=self.policy.slower_than
        )
        if done is None:
            return
        (first, inside0, calls0, delay0), (_, _, calls, delay), seconds = done
        count = delivered - first
        consumer_s = max(seconds - (inside_s - inside0), 0.0) / count
        waited = grown(delay0, delay) if self.kind == INLINE else 0.0
        self._review(seconds / count, consumer_s, calls, calls0, seconds, waited)

    def _review(
        self,
        seconds_per_element: float,
        consumer_s: float,
        calls: tuple[int, float, float],
        calls0: tuple[int, float, float],
        window_s: float,
        waited_s: float,
    ) -> None:
        """Judge a window of ``window_s`` seconds (a full one lasts the cadence's): the
        ``seconds_per_element`` the consumer got, its own ``consumer_s`` an element, the calls'
        timing totals at its end and start; ``waited_s`` of its seconds this thread waited for a
        core others held (inline calls run on it: their share of that wait is the machine's
        load, not the calls', which would otherwise look as if they waited on I/O and ask for
        threads: ``blobs``' 0.15 ms batches read 0.34 ms of wall to 0.07 of CPU on a busy
        machine, and went to 10 threads)."""
        policy = self.policy
        assert policy is not None and policy.costs is not None  # reviewed: a policy that decided
        per_result = getattr(self.dispatcher.executor, "message_seconds", lambda: None)()
        if self.kind == PROCESS and per_result is not None:  # what a result really costs here
            observe_message_cost(max(per_result - transfer_seconds(policy.costs), 0.0))
        policy.costs = dataclasses.replace(policy.costs, consumer_s=consumer_s)
        before = policy.costs
        ran = calls[0] - calls0[0]
        changed = False
        if ran > 0:
            wall, cpu = (calls[1] - calls0[1]) / ran, (calls[2] - calls0[2]) / ran
            if waited_s > 0 and window_s > 0:  # the calls' part of the wait, by their time
                wall = max(wall - waited_s * min(1.0, wall * ran / window_s) / ran, cpu)
            # Off this thread a call's wall time swings with contention (the GIL, the cores): its
            # CPU time tells a workload that changed.
            changed = self._driver.changed(wall if self.kind == INLINE else cpu)
            self._update_call_cost(wall, cpu, changed, self._inline_share(wall, cpu, ran, changed))
        if changed:
            if not self._driver.agreed(REBASE):
                return
            verdict = policy.rebase(policy.costs, cost_scale(before, policy.costs))
        else:
            verdict = policy.review(seconds_per_element, window_s >= self._driver.cadence.seconds)
            if verdict == self.kind:
                self.stayed()
            # Windows in a row must say to leave for an executor only predicted; where to may
            # differ between two about as fast (inline, then threads): the latest verdict is
            # taken. Back to one measured lately, a measurement against a measurement, the calls
            # go at once: a trial that lost costs one window, not two.
            agreed = self._driver.agreed(LEAVE if verdict != self.kind else verdict)
            back = (
                verdict in policy.measured and self.kind in policy.measured and not self._held_here
            )
            if verdict == self.kind or not (agreed or back):
                return
        self.move(verdict, workers(policy.costs, verdict, policy.cores))

    def _inline_share(self, wall: float, cpu: float, ran: int, changed: bool) -> float:
        """The CPU share of an inline call, over every window since the calls came here (or
        since they changed): a window's CPU time is sampled (one cheap call in 16, ~8 a window
        of ``blobs``' batches), and one window's share swung 0.35-1.0 on calls that compute
        throughout; that share decides whether calls wait enough to overlap on threads."""
        if self.kind != INLINE:
            return 1.0
        if changed:
            self._windows.pop("inline_calls", None)
        totals = self._windows.setdefault("inline_calls", [0.0, 0.0])  # wall, CPU
        totals[0] += wall * ran
        totals[1] += cpu * ran
        return min(1.0, totals[1] / totals[0]) if totals[0] > 0 else 1.0

    def _update_call_cost(self, wall: float, cpu: float, changed: bool, share: float) -> None:
        """What a call alone costs, from a window's calls. Inline, their wall time is just that
        and ``share`` their CPU share (:meth:`_inline_share`). Elsewhere the wall time is
        contended, but the CPU time is not: over the call's CPU share (as first measured) it
        says what a call alone costs, which corrects the first calls' warm-up (always) and
        follows a workload that changed."""
        assert self.policy is not None and self.policy.costs is not None  # from _review
        costs = self.policy.costs
        if self.kind == INLINE:
            alone = wall
        else:
            share = min(1.0, max(costs.cpu_s / costs.call_s, 0.05)) if costs.call_s > 0 else 1.0
            alone = cpu / share
            if not changed and alone >= costs.call_s:
                return
        self.policy.costs = dataclasses.replace(costs, call_s=alone, cpu_s=alone * share)

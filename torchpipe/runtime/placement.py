"""Where one stage's calls run, chosen by the policy and moved while the stage runs.

A :class:`Placement` is what map, the DataLoader and interleave share for ``executor="auto"``
(and ``num_workers="auto"``): it measures the first calls inline (:func:`measure_calls`), asks
the :class:`~torchpipe.runtime.policy.Policy` where they should run, puts that executor under the
stage's :class:`~torchpipe.runtime.dispatch.Dispatcher`, and after every window of delivered
elements reports what the consumer got, moving the calls when the policy says so. A move never
loses, repeats or reorders an element: tasks in flight finish where they are, and results keep
their sequence numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from torchpipe.randomness import GlobalDraws, watch_global_draws
from torchpipe.runtime import codec
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.executor import Executor
from torchpipe.runtime.gil import GilProbe
from torchpipe.runtime.policy import INLINE, PROCESS, CallCosts, Policy, observe_message_cost, workers
from torchpipe.runtime.timing import CallTiming

_WINDOW_ELEMENTS, _WINDOW_S = 4, 0.15  # a window to judge an executor by: this many, this long
_SETTLE_ELEMENTS, _SETTLE_S = 2, 0.05  # after a move, not judged: threads start, buffers fill
_SETTLE_PROCESS_S = 0.25  # and workers fork and fault their rings in (first windows ran 2x slow)
_PROBE_CALLS, _PROBE_S = 8, 0.02  # calls measured inline before the first decision (at most; at least one)
_MOVE_SAMPLES = 3  # decodings timed for the cost of receiving a result (the fastest counts)

_REBASE = "rebase"  # a pending verdict: the calls' cost changed, decide afresh
MakeExecutor = Callable[[str, int], Executor]
"""``make(kind, workers)``: the stage's executor of ``kind`` with ``workers`` threads or processes."""


def measure_calls(
    run: Callable[[int], list[Any]], limit: int = _PROBE_CALLS, on_draws: Callable[[GlobalDraws], None] | None = None
) -> tuple[CallCosts, int]:
    """Run up to ``limit`` calls inline (``run(n)`` runs at most ``n`` and returns their results);
    what one call costs, and how many ran.

    The first half run beside a GIL probe, which measures the share of a call the GIL is free but
    slows calls that release it often (each release lets the probe in); the rest run alone, and
    their median is the cost of a call (the first calls pay for warm-up, any may pay for a
    garbage collection). The cost of moving a result between processes is that of decoding the
    first one. With ``on_draws``, the first half also finds out which global RNGs the calls draw
    from (``watch_global_draws``; the time that takes is left out), and ``on_draws`` is told
    before the second half runs.
    """
    results: list[Any] = []
    cpu0 = time.thread_time()
    watching = watch_global_draws() if on_draws is not None else contextlib.nullcontext()
    with GilProbe() as probe, watching as draws:
        overhead = (lambda: draws.overhead_s) if draws is not None else None
        probed = _timed_calls(run, limit // 2, _PROBE_S / 2, results, overhead, probe)
    if on_draws is not None:
        on_draws(cast(GlobalDraws, draws))  # watched: not the nullcontext's None
    alone = _timed_calls(run, limit - len(results), _PROBE_S / 2, results, None) if probed else []
    cpu = time.thread_time() - cpu0
    if not probed:
        return CallCosts(0.0, 0.0, 1.0, 0.0), 0
    wall = sum(s for s, _ in probed) + sum(s for s, _ in alone)
    probed_s = sum(s for s, _ in probed)
    call_s = statistics.median([s for s, _ in (alone or probed)])
    costs = CallCosts(
        call_s=call_s,
        cpu_s=call_s * min(1.0, cpu / wall) if wall > 0 else call_s,
        gil_free=sum(s * free for s, free in probed) / probed_s if probed_s > 0 else 1.0,
        move_s=move_seconds(results[0]),
    )
    return costs, len(results)


def _timed_calls(
    run: Callable[[int], list[Any]], limit: int, seconds: float, results: list[Any],
    overhead: Callable[[], float] | None, probe: GilProbe | None = None,
) -> list[tuple[float, float]]:  # fmt: skip
    """Up to ``limit`` calls (at least one, if any is left) for at most about ``seconds``:
    ``(seconds, GIL-free share)`` of each, less ``overhead``; their results added to ``results``."""
    timed: list[tuple[float, float]] = []
    deadline = time.perf_counter() + seconds
    while len(timed) < max(limit, 1):
        spent = overhead() if overhead is not None else 0.0
        if probe is not None:
            done, free, took = probe.measure(lambda: run(1))
        else:
            t0 = time.perf_counter()
            done, free = run(1), 0.0
            took = time.perf_counter() - t0
        if not done:
            break
        results.extend(done)
        timed.append((max(took - ((overhead() - spent) if overhead is not None else 0.0), 1e-9), free))
        if time.perf_counter() > deadline:
            break
    return timed


def move_seconds(result: Any) -> float:
    """Seconds this process would spend decoding ``result`` had a worker sent it (the fastest of a
    few tries; the encoding is the worker's)."""
    try:
        encoded = codec.encode(codec.materialize(result))
    except Exception:  # noqa: BLE001 - cannot travel: processes would fail on it
        return float("inf")
    record = np.empty(encoded.nbytes, np.uint8)
    encoded.write_into(memoryview(record))  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only
    best = float("inf")
    for _ in range(_MOVE_SAMPLES):
        t0 = time.perf_counter()
        codec.decode_view(record)
        best = min(best, time.perf_counter() - t0)
    return best


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
    """

    def __init__(
        self, dispatcher: Dispatcher, make: MakeExecutor, policy: Policy | None, timing: CallTiming,
        on_move: Callable[[str, int], None] | None = None, retire: Callable[[Executor], None] | None = None,
    ) -> None:  # fmt: skip
        self.dispatcher = dispatcher
        self.policy = policy
        self.kind = INLINE
        self.workers = 0
        self._make = make
        self._timing = timing
        self._on_move = on_move
        self._retire = retire
        self._window: tuple[float, int, float, tuple[int, float, float]] | None = None
        self._delivered = 0
        self._settle = (0, 0.0)  # (elements delivered, time) before which nothing is judged
        self._base_call_s: float | None = None  # a call's cost in the first window on this executor
        self._pending: str | None = None  # a move the last window asked for, until the next agrees

    def move(self, kind: str, count: int) -> None:
        """Run new calls on ``kind`` with ``count`` threads or processes from now on."""
        count = 0 if kind == INLINE else max(count, 1)
        if kind != self.kind:
            self.dispatcher.switch(self._make(kind, count), self._retire)
        elif count != self.workers:
            self.dispatcher.executor.resize(count)
        self.kind, self.workers = kind, count
        if self.policy is not None:
            self.policy.kind = kind
        self._window, self._base_call_s, self._pending = None, None, None
        settle_s = _SETTLE_PROCESS_S if kind == PROCESS else _SETTLE_S  # workers fork, rings fill
        self._settle = (self._delivered + _SETTLE_ELEMENTS, time.perf_counter() + settle_s)
        if self._on_move is not None:
            self._on_move(self.kind, self.workers)

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
        self.move(kind, count)
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
        its ``next()`` so far (the rest is the consumer's). Every window the policy sees what the
        consumer got."""
        self._delivered += 1
        if self.policy is None or self._delivered < self._settle[0]:
            return
        now = time.perf_counter()
        if now < self._settle[1]:
            return
        if self._window is None:
            self._window = (now, self._delivered, inside_s, self._timing.totals())
            return
        start, first, inside0, calls0 = self._window
        count = self._delivered - first
        if count < _WINDOW_ELEMENTS or now - start < _WINDOW_S:
            return
        self._window = None
        seconds = now - start
        consumer_s = max(seconds - (inside_s - inside0), 0.0) / count
        self._review(seconds / count, consumer_s, self._timing.totals(), calls0)

    def _review(self, seconds_per_element: float, consumer_s: float, calls: tuple[int, float, float],
                calls0: tuple[int, float, float]) -> None:  # fmt: skip
        policy = self.policy
        assert policy is not None and policy.costs is not None  # reviewed: a policy that decided
        per_result = getattr(self.dispatcher.executor, "message_seconds", lambda: None)()
        if self.kind == PROCESS and per_result is not None:  # what a result really costs here
            observe_message_cost(max(per_result - policy.costs.move_s, 0.0))
        policy.costs = dataclasses.replace(policy.costs, consumer_s=consumer_s)
        ran = calls[0] - calls0[0]
        changed = False
        if ran > 0:
            wall, cpu = (calls[1] - calls0[1]) / ran, (calls[2] - calls0[2]) / ran
            # Off this thread a call's wall time swings with contention (the GIL, the cores): its
            # CPU time tells a workload that changed.
            marker = wall if self.kind == INLINE else cpu
            changed = self._changed(marker)
            if not changed:
                self._base_call_s = marker  # the last window like the one before: what a call costs now
            self._update_call_cost(wall, cpu, changed)
        # One window can mislead (a cold start, a busy moment): a move waits for the next to agree.
        if changed:
            if self._pending != _REBASE:
                self._pending = _REBASE
                return
            verdict = policy.rebase(policy.costs)
        else:
            verdict = policy.review(seconds_per_element)
            if verdict == self.kind or verdict != self._pending:
                self._pending = None if verdict == self.kind else verdict
                return
        self.move(verdict, workers(policy.costs, verdict, policy.cores))

    def _update_call_cost(self, wall: float, cpu: float, changed: bool) -> None:
        """What a call alone costs, from a window's calls. Inline, their wall time is just that.
        Elsewhere the wall time is contended, but the CPU time is not: over the call's CPU share
        (as first measured) it says what a call alone costs, which corrects the first calls'
        warm-up (always) and follows a workload that changed."""
        assert self.policy is not None and self.policy.costs is not None  # from _review
        costs = self.policy.costs
        if self.kind == INLINE:
            alone, share = wall, min(1.0, cpu / wall) if wall > 0 else 1.0
        else:
            share = min(1.0, max(costs.cpu_s / costs.call_s, 0.05)) if costs.call_s > 0 else 1.0
            alone = cpu / share
            if not changed and alone >= costs.call_s:
                return
        self.policy.costs = dataclasses.replace(costs, call_s=alone, cpu_s=alone * share)

    def _changed(self, marker: float) -> bool:
        """Whether a call now costs more than twice, or less than half, what it did in the last
        window before (or, while a change waits to be confirmed, before the change)."""
        base = self._base_call_s
        return base is not None and max(marker, base) > 2.0 * max(min(marker, base), 1e-9)

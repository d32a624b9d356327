"""Where one stage's calls run, chosen by the policy and moved while the stage runs.

Every stage that moves its work while it runs goes through one driver, :class:`MoveDriver`, with
one set of constants (below): it cuts what the stage delivers into windows (:class:`Cadence`),
judges nothing while a move settles, acts on a verdict of the policy only once ``agree`` windows
in a row gave it, and tells a workload that changed (:data:`CHANGED`). Its users: a
:class:`Placement` (map and the DataLoader), an interleave's
:class:`~torchpipe.ops.interleave.placement.ReaderPlacement` (threads or worker processes) and a
prefetch's :class:`~torchpipe.ops.prefetch.OverlapChoice` (its thread or inline); which placement
is better, given the measurements, is :mod:`~torchpipe.runtime.placement.policy`'s call.

A :class:`Placement` is what map and the DataLoader share for ``executor="auto"``
(and ``num_workers="auto"``): it measures the first calls inline (:func:`measure_calls`), asks
the :class:`~torchpipe.runtime.placement.policy.Policy` where they should run, puts that executor under the
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
from torchpipe.runtime.cpu import as_a_pool_thread_runs
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.executor import Executor
from torchpipe.runtime.placement.gil import GilProbe
from torchpipe.runtime.placement.memory_costs import MMAP_THRESHOLD_MAX, calibrate, cold_seconds, thread_faults
from torchpipe.runtime.placement.policy import (
    INLINE,
    PROCESS,
    CallCosts,
    Policy,
    observe_message_cost,
    transfer_seconds,
    workers,
)
from torchpipe.runtime.timing import CallTiming

_PROBE_CALLS, _PROBE_S = 8, 0.02  # calls measured inline before the first decision (at most; at least one)
_MOVE_SAMPLES = 3  # decodings timed for the cost of receiving a result (the fastest counts)
_CALL_FLOOR = 0.1  # a call is taken to cost at least this share of its time, whatever it faulted

# -- the driver's constants: one set for every stage that moves its work ---------------------------
CHANGED = 2.0
"""A cost per element (a call's, a read's, the consumer's own) that grows or shrinks by more than
this factor between windows is another workload: what was measured before no longer counts."""
CHANGED_FLOOR_S = 1e-7
"""Costs below this many seconds are taken as this much when telling a change (timer noise)."""
SETTLE_S = 0.05
"""After a move to inline or threads, seconds during which nothing is judged: threads start,
buffers fill."""
SETTLE_PROCESS_S = 0.05
"""The same after a move to worker processes: they fork and fault their rings in. Their first
results are not judged either (:meth:`Placement.move`): two a worker, its first call cold."""
AGREE = 2
"""Windows in a row whose verdicts must agree before work moves: one can mislead (a cold start, a
busy moment)."""
LEAVE = "leave"
"""What a window says of a stage's placement when the policy would move the work elsewhere."""
REBASE = "rebase"
"""The verdict a window gives when the cost per element changed (:data:`CHANGED`): decide afresh."""


@dataclasses.dataclass(frozen=True)
class Cadence:
    """How a driver cuts what a stage delivers into windows to judge.

    Attributes:
        elements: a window holds at least this many of what the stage counts (elements
            delivered; reads, for an interleave's readers).
        seconds: and lasts at least this long.
        settle_elements: elements delivered before the first window starts, and after a move
            (unless the move says how many).
        agree: verdicts in a row that must agree before work moves (:data:`AGREE`).
        settle_s: after a move to inline or threads, seconds before a window starts (:data:`SETTLE_S`).
        settle_process_s: the same after a move to worker processes (:data:`SETTLE_PROCESS_S`).
        every: elements delivered between two looks at the stage's counters.
    """

    elements: int
    seconds: float
    settle_elements: int
    agree: int = AGREE
    settle_s: float = SETTLE_S
    settle_process_s: float = SETTLE_PROCESS_S
    every: int = 1


CALLS = Cadence(elements=4, seconds=0.15, settle_elements=2)
"""Map's and the DataLoader's calls: a few calls make a window (a call may take a second)."""
READS = Cadence(elements=32, seconds=0.05, settle_elements=16, every=16)
"""An interleave's readers: windows of reads, looked at every 16 elements (a look reads the
counters of every reader's calls)."""
OVERLAP = Cadence(elements=16, seconds=0.1, settle_elements=4, agree=1, settle_s=0.0, settle_process_s=0.0)
"""A prefetch's thread against inline: its elements take microseconds, its thread starts in as
many and its buffer holds two, so it needs no settling, and it acts on one window (trying the
other mode costs one window, and the policy compares measurements with measurements)."""


def cost_changed(now: float, before: float | None) -> bool:
    """Whether a cost per element is another workload's: it moved by more than :data:`CHANGED`."""
    return before is not None and max(now, before) > CHANGED * max(min(now, before), CHANGED_FLOOR_S)


class MoveDriver:
    """The measure-and-move loop of a stage whose work can move between placements.

    The stage reports each element it delivers (:meth:`window`); the driver cuts them into
    windows of its :class:`Cadence`, none while a move settles, each starting where the last
    ended. The stage asks its policy for a verdict on each window and acts on it once
    :meth:`agreed`; :meth:`changed` tells a cost that changed (the verdict is then
    :data:`REBASE`, agreed on like any other). :meth:`moved` starts over on the new placement.

    Args:
        cadence: the windows' sizes and the settling.
    """

    def __init__(self, cadence: Cadence) -> None:
        self.cadence = cadence
        self._settle = (cadence.settle_elements, 0.0)  # (elements delivered, time) before which nothing is judged
        self._start: tuple[float, int, Any] | None = None  # (time, count, the stage's look) where the window began
        self._pending: str | None = None  # the verdict of the last windows, not yet agreed on enough
        self._streak = 0
        self._base: float | None = None  # the cost per element of the last window like the one before

    def moved(self, kind: str, settle_at: int, now: float, again: bool = False) -> None:
        """The work runs on ``kind`` from now on: nothing is judged before ``settle_at`` elements
        were delivered and the cadence's settling time passed; what was pending is dropped,
        unless the work runs where it ran before (``again``: a new pass's executor)."""
        settle_s = self.cadence.settle_process_s if kind == PROCESS else self.cadence.settle_s
        self._settle = (settle_at, now + settle_s)
        self._start = None
        if not again:
            self._pending, self._streak, self._base = None, 0, None

    def window(
        self, now: float, delivered: int, look: Callable[[], Any], count: int | None = None, last: bool = False
    ) -> tuple[Any, Any, float] | None:
        """After an element: once a window is complete, the stage's looks at its start and its end
        (``look()``) and its seconds; else None.

        Args:
            now: the time.
            delivered: elements delivered so far.
            look: the stage's counters now (called only where a window starts or ends).
            count: what the cadence counts so far, if not elements delivered (reads).
            last: the pass ends here: the open window is complete if it holds the cadence's
                elements, however short it is (an epoch of 50 ms is judged once); no window
                spans two passes.
        """
        count = delivered if count is None else count
        if self._start is None:
            if not last and delivered >= self._settle[0] and now >= self._settle[1]:
                self._start = (now, count, look())
            return None
        start, count0, first = self._start
        if count - count0 < self.cadence.elements or (now - start < self.cadence.seconds and not last):
            if last:
                self._start = None
            return None
        end = look()
        self._start = None if last else (now, count, end)
        return first, end, now - start

    def new_pass(self, delivered: int) -> None:
        """A pass starts with ``delivered`` elements delivered before it: its first
        ``settle_elements`` are not judged (the stage fills its buffers), nor the elements a move
        left to settle, but the settling time has passed (workers started between the passes)."""
        self._start = None
        self._settle = (max(self._settle[0], delivered + self.cadence.settle_elements), 0.0)

    def agreed(self, verdict: str) -> bool:
        """Whether ``verdict`` is the cadence's ``agree``-th in a row; it is then acted on, so the
        count starts over."""
        if verdict == self._pending:
            self._streak += 1
        else:
            self._pending, self._streak = verdict, 1
        if self._streak < self.cadence.agree:
            return False
        self._pending, self._streak = None, 0
        return True

    def changed(self, cost: float) -> bool:
        """Whether ``cost`` (per element, this window) differs by :data:`CHANGED` from the last
        window's that did not (while a change waits to be agreed on: from before the change)."""
        changed = cost_changed(cost, self._base)
        if not changed:
            self._base = cost
        return changed

    def baseline(self, cost: float) -> None:
        """Compare later windows with ``cost`` (the new workload's, once a change is acted on)."""
        self._base = cost


MakeExecutor = Callable[[str, int], Executor]
"""``make(kind, workers)``: the stage's executor of ``kind`` with ``workers`` threads or processes."""


def prepare_measurements() -> None:
    """Measure ahead, once a process, what the first decision needs to know of the machine (the
    GIL probe's rate, :func:`~torchpipe.runtime.placement.memory_costs.calibrate`; ~25 ms): a stage that
    will place its calls calls this when it is made, so its first elements do not wait for it."""
    calibrate()
    GilProbe.calibrate()


def measure_calls(
    run: Callable[[int], list[Any]], limit: int = _PROBE_CALLS, on_draws: Callable[[GlobalDraws], None] | None = None
) -> tuple[CallCosts, int]:
    """Run up to ``limit`` calls inline (``run(n)`` runs at most ``n`` and returns their results);
    what one call costs at steady state, and how many ran.

    The first half run beside a GIL probe, which measures the share of a call the GIL is free but
    slows calls that release it often (each release lets the probe in); the rest run alone, and
    their median is the cost of a call. They run with one intra-op thread for torch's ops, as on a
    pool thread or in a worker process (:func:`~torchpipe.runtime.cpu.as_a_pool_thread_runs`).
    The first calls are not like the later ones: they fault
    in every page of the results they make, which are all kept until the consumer takes them,
    where later calls reuse the pages of results the consumer dropped; what those faults cost
    (:func:`~torchpipe.runtime.placement.memory_costs.cold_seconds`) is left out of every call, as are
    imports and warm-up by the median. The cost of moving a result between processes is that
    of decoding the first one, and its size (:func:`move_costs`). With ``on_draws``, the first
    half also finds out which global RNGs the calls draw from (``watch_global_draws``; the time
    that takes is left out), and ``on_draws`` is told before the second half runs.
    """
    results: list[Any] = []
    cpu0 = time.thread_time()
    watching = watch_global_draws() if on_draws is not None else contextlib.nullcontext()
    with as_a_pool_thread_runs():
        with GilProbe() as probe, watching as draws:
            overhead = (lambda: draws.overhead_s) if draws is not None else None
            probed = _timed_calls(run, limit // 2, _PROBE_S / 2, results, overhead, probe)
        if on_draws is not None:
            on_draws(cast(GlobalDraws, draws))  # watched: not the nullcontext's None
        alone = _timed_calls(run, limit - len(results), _PROBE_S / 2, results, None) if probed else []
    cpu = time.thread_time() - cpu0
    if not probed:
        return CallCosts(0.0, 0.0, 1.0, 0.0), 0
    move_s, nbytes, steady_bytes = move_costs(results[0])
    cold = [cold_seconds(faults, steady_bytes) for _, _, faults in probed + alone]
    wall = sum(s for s, _, _ in probed + alone)
    # A fault is CPU time of this thread: the faults' priced time cannot exceed the CPU the calls
    # took (a fault in the allocator can cost less than the calibration's; the price is an
    # estimate), else the calls would seem to wait, and ask for dozens of threads.
    cold_s = min(sum(cold), wall * (1 - _CALL_FLOOR), cpu * (1 - _CALL_FLOOR))
    share = cold_s / sum(cold) if sum(cold) > 0 else 0.0
    probed_s = sum(s for s, _, _ in probed)
    steady = [max(s - c * share, s * _CALL_FLOOR) for (s, _, _), c in zip(probed + alone, cold)]
    call_s = statistics.median(steady[len(probed) :] or steady)
    costs = CallCosts(
        call_s=call_s,
        cpu_s=call_s * min(1.0, (cpu - cold_s) / (wall - cold_s)) if wall > cold_s else call_s,
        gil_free=sum(s * free for s, free, _ in probed) / probed_s if probed_s > 0 else 1.0,
        move_s=move_s,
        nbytes=nbytes,
    )
    return costs, len(results)


def _timed_calls(
    run: Callable[[int], list[Any]], limit: int, seconds: float, results: list[Any],
    overhead: Callable[[], float] | None, probe: GilProbe | None = None,
) -> list[tuple[float, float, int]]:  # fmt: skip
    """Up to ``limit`` calls (at least one, if any is left) for at most about ``seconds``:
    ``(seconds, GIL-free share, page faults)`` of each, less ``overhead``; their results added
    to ``results``."""
    timed: list[tuple[float, float, int]] = []
    deadline = time.perf_counter() + seconds
    while len(timed) < max(limit, 1):
        spent = overhead() if overhead is not None else 0.0
        faults = thread_faults()
        if probe is not None:
            done, free, took = probe.measure(lambda: run(1))
        else:
            t0 = time.perf_counter()
            done, free = run(1), 0.0
            took = time.perf_counter() - t0
        if not done:
            break
        faulted = thread_faults()
        results.extend(done)
        took -= (overhead() - spent) if overhead is not None else 0.0
        timed.append((max(took, 1e-9), free, faulted - faults if faults is not None and faulted is not None else 0))
        if time.perf_counter() > deadline:
            break
    return timed


def move_costs(result: Any) -> tuple[float, int, int]:
    """What moving ``result`` from a worker costs: the seconds this process would spend decoding
    it (the fastest of a few tries; the encoding is the worker's), the bytes a move copies on
    each side (its blobs and pickled data; tensors and arrays are written once, in place of the
    stacking this process would do, and viewed where they land), and the bytes of its blocks so
    large that the allocator maps them afresh for every result
    (:data:`~torchpipe.runtime.placement.memory_costs.MMAP_THRESHOLD_MAX`). A result that cannot travel
    costs infinite seconds."""
    try:
        encoded = codec.encode(codec.materialize(result))
    except Exception:  # noqa: BLE001 - cannot travel: processes would fail on it
        return float("inf"), 0, 0
    record = np.empty(encoded.nbytes, np.uint8)
    encoded.write_into(memoryview(record))  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only
    best = float("inf")
    for _ in range(_MOVE_SAMPLES):
        t0 = time.perf_counter()
        codec.decode_view(record)
        best = min(best, time.perf_counter() - t0)
    return best, encoded.copied_bytes, encoded.bytes_in_blocks(MMAP_THRESHOLD_MAX)


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
    """

    def __init__(
        self, dispatcher: Dispatcher, make: MakeExecutor, policy: Policy | None, timing: CallTiming,
        on_move: Callable[[str, int], None] | None = None, retire: Callable[[Executor], None] | None = None,
        learned: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.dispatcher = dispatcher
        self.policy = policy
        self.kind = INLINE
        self.workers = 0
        self._make = make
        self._timing = timing
        self._on_move = on_move
        self._retire = retire
        # The windows go on from one pass to the next (an epoch may be shorter than a window).
        self._windows = learned if learned is not None else {}
        self._driver: MoveDriver = self._windows.setdefault("driver", MoveDriver(CALLS))
        self._windows.setdefault("delivered", 0)

    @property
    def _delivered(self) -> int:
        return cast(int, self._windows["delivered"])

    @property
    def most(self) -> int | None:
        """The most threads or processes any move may start (None: no cap; 0: calls run inline),
        kept from one pass to the next: a RAM budget's verdict."""
        return cast("int | None", self._windows.get("most"))

    def cap(self, most: int) -> None:
        """From now on run calls on at most ``most`` threads or processes (0: inline)."""
        self._windows["most"] = most
        if self.workers > most:
            self.move(self.kind, most)

    def move(self, kind: str, count: int, again: bool = False) -> None:
        """Run new calls on ``kind`` with ``count`` threads or processes from now on (at most
        :attr:`most`). What is in flight, made where the calls ran before, is not judged, nor the
        first two results of each worker process. ``again``: a new pass goes on where the last
        one ran its calls."""
        if self.most is not None:
            count = min(count, self.most)
            kind = INLINE if count < 1 else kind
        count = 0 if kind == INLINE else max(count, 1)
        if kind != self.kind:
            self.dispatcher.switch(self._make(kind, count), self._retire)
        elif count != self.workers:
            self.dispatcher.executor.resize(count)
        self.kind, self.workers = kind, count
        if self.policy is not None:
            self.policy.kind = kind
        unjudged = self._driver.cadence.settle_elements + self.dispatcher.pending
        unjudged += 2 * count if kind == PROCESS else 0
        self._driver.moved(kind, self._delivered + unjudged, time.perf_counter(), again)
        if self._on_move is not None:
            self._on_move(self.kind, self.workers)

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
        look = lambda: (delivered, inside_s, self._timing.totals())  # noqa: E731 - read only where a window starts or ends
        done = self._driver.window(time.perf_counter(), delivered, look, last=last)
        if done is None:
            return
        (first, inside0, calls0), (_, _, calls), seconds = done
        count = delivered - first
        consumer_s = max(seconds - (inside_s - inside0), 0.0) / count
        self._review(seconds / count, consumer_s, calls, calls0)

    def _review(self, seconds_per_element: float, consumer_s: float, calls: tuple[int, float, float],
                calls0: tuple[int, float, float]) -> None:  # fmt: skip
        policy = self.policy
        assert policy is not None and policy.costs is not None  # reviewed: a policy that decided
        per_result = getattr(self.dispatcher.executor, "message_seconds", lambda: None)()
        if self.kind == PROCESS and per_result is not None:  # what a result really costs here
            observe_message_cost(max(per_result - transfer_seconds(policy.costs), 0.0))
        policy.costs = dataclasses.replace(policy.costs, consumer_s=consumer_s)
        ran = calls[0] - calls0[0]
        changed = False
        if ran > 0:
            wall, cpu = (calls[1] - calls0[1]) / ran, (calls[2] - calls0[2]) / ran
            # Off this thread a call's wall time swings with contention (the GIL, the cores): its
            # CPU time tells a workload that changed.
            changed = self._driver.changed(wall if self.kind == INLINE else cpu)
            self._update_call_cost(wall, cpu, changed)
        if changed:
            if not self._driver.agreed(REBASE):
                return
            verdict = policy.rebase(policy.costs)
        else:
            verdict = policy.review(seconds_per_element)
            # Windows in a row must say to leave; where to may differ between two about as fast
            # (inline, then threads): the latest verdict is taken.
            if not self._driver.agreed(LEAVE if verdict != self.kind else verdict) or verdict == self.kind:
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

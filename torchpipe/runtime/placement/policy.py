"""Where a stage's calls run: the one rule that map, interleave and the DataLoader share.

A call can run **inline** (on the consumer's thread, when the consumer asks for its element), on
**threads** of this process, or in worker **processes**. Which is fastest follows from a few
measured costs (:class:`~torchpipe.runtime.placement.costs.CallCosts`): what one call costs (wall
and CPU time), the share of it during which the GIL is free, what it costs this process to
receive a result from a worker, and the consumer's own time per element.
:func:`~torchpipe.runtime.placement.costs.predict` turns them into seconds per element for each
executor; :func:`choose` takes the fastest, where a dearer executor (threads over inline,
processes over threads: start-up, memory) must win by ``MARGIN``.

The prediction is only as good as the costs it is given. So a running stage measures what the
executor it chose really delivers, and :class:`Policy` re-decides from the measurements: a time
measured on an executor replaces its prediction, and a stage whose call costs change (a workload
that gets dearer mid-epoch) is predicted afresh. docs/executors.md states the rule in prose.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from typing import Any

from torchpipe.runtime.placement.costs import (
    INLINE,
    KINDS,
    PROCESS,
    THREAD,
    CallCosts,
    predict,
)

MARGIN = 1.15
"""How much faster a dearer executor must be predicted (or measured) to be chosen."""
STAY = 1.05
"""How much faster a cheaper executor must be (measured or predicted) to take the calls from the
one they run on. Windows of a few large batches swing window to window (``jpeg`` on 3 worker
processes: 22-39 ms a batch), and a move costs its settling and windows: the DataLoader's
``jpeg`` left processes (30.8 ms, its fastest of 3 windows) for threads (30.0, measured 3 s
before) and measured 39-43 ms there."""
READERS_MARGIN = 1.5
"""The same for moving an interleave's readers to the other pool, either way: every open reader
re-opens its inner dataset there, which for a stream that resumes by reading from its start costs
what it read."""
EXPLORE = 1.1
"""Processes not measured yet are tried where predicted no more than this many times slower than
the current executor measured (or faster): the model is this uncertain between executors
predicted alike (threads for JPEG decodes and TFRecord parses, 70-85% GIL-free, are predicted as
fast as processes and measure 1.1-1.3x slower; tried only where predicted 1.1x faster, processes
were never measured from threads). Threads must be predicted this much faster."""
EXPLORE_INLINE = 1.3
"""Inline is tried even when predicted up to 1.3x slower: trying it costs nothing to start, and its
prediction comes from the first calls, which pay for warm-up (fresh memory for every result they
keep: the dict rows of the ``records`` benchmark took 1.8 ms a batch then, 0.95 ms later). Not
further: a window of calls that are clearly faster elsewhere (JPEG batches: 1.6x on processes)
costs a second of throughput."""
_TRIED_WITHIN = {INLINE: EXPLORE_INLINE, THREAD: 1 / EXPLORE, PROCESS: EXPLORE}
"""An executor not measured is tried where predicted below this many times the current one's
measure. Threads must be predicted faster: their prediction is the GIL's, and they are tried
whatever it says where it may miss (:data:`THREAD_TRIAL_S`). So must processes from inline
(:data:`_FROM_INLINE`)."""
_FROM_INLINE = {PROCESS: 1 / EXPLORE}
"""From inline, processes too must be predicted ``EXPLORE`` times faster to be tried: calls that
run inline are cheap beside what a worker's result costs this process, and a window on
processes, each pool forked and warmed up on the cores the consumer needs, cost ``records``'
0.15 ms batches 1.6-3 ms each where predicted about as fast as inline (EXPLORE's reason, a
prediction that ties with threads' on calls that overlap there, does not hold from inline)."""
WINDOWS_KEPT = 3
"""An executor's time per element is the lower median of its last this many windows (the faster
of two, the middle of three). Windows swing both ways: other work on the machine slows one down,
and one in which a buffer drains (elements made before it began) or a burst of batches lands runs
faster than the executor can (``bigtensor``'s DSL inline: windows of 7.4, 10.3, 5.3 and 6.8 ms a
batch; judged by its fastest, 5.3, it took the calls back from threads at 5.6 and measured 9.6
and 7.1). One window either way moves nothing. The calls run this many windows where they are
before another executor is tried, and a trial runs until it has as many windows as the executor
it would go back to (unless it loses big: :data:`LOSES_BIG`)."""
LOSES_BIG = 1.5
"""A trial measured this many times slower than an executor measured before goes back at once."""
THREAD_TRIAL_S = 1e-3
"""Inline calls at least this long get a window on threads whatever the GIL probe predicted
(shorter ones would lose more to the hand-off than a missed GIL release could win)."""
THREAD_TRIAL_FREE = 0.1
"""Nor do calls the GIL probe saw free less than this share of the time (pure Python: the
``text`` workload's tokenizer, 0.02-0.05, measured 2.2x slower on threads than on processes, at
every trial): the probe may miss short releases, but not nine in ten. ``bigtensor``'s torch ops
(0.3-0.5) are still tried, and ran fastest on threads. A call whose wall time is more than its
CPU time waits meanwhile, with the GIL free, whatever the probe saw of the first calls."""
STALE_S = 10.0
"""A time measured on an executor longer ago than this no longer stands in for its prediction (a
busy moment must not rule an executor out for good)."""
STALE_MAX_S = 160.0
"""Each time the calls leave an executor they were measured on, its measurement stands twice as
long before it goes stale (10 s, 20, 40, ... up to this): a trial that loses again costs a
window each time, so an executor that keeps losing is tried less and less often."""


def processes_cannot_win(costs: CallCosts, cores: int) -> bool:
    """Whether processes lose to inline whatever moving a result costs: with ``costs.move_s`` at
    the least a move can cost (a copy of the result's bytes), they are predicted
    :data:`EXPLORE_INLINE` times slower than inline or more, beyond a trial's reach
    (:data:`EXPLORE`) and the model's usual miss on the consumer's side. Then the move's price
    need not be measured (``blobs``: 32 rows of 64 KB at 0.15 ms a batch, ~3 ms of decodes in
    an epoch of 20)."""
    return predict(costs, PROCESS, cores) >= EXPLORE_INLINE * predict(costs, INLINE, cores)


def choose(
    costs: CallCosts,
    cores: int,
    candidates: tuple[str, ...],
    measured: dict[str, float] | None = None,
    current: str | None = None,
    margin: float = MARGIN,
    move_margin: float | None = None,
) -> str:
    """The executor for ``costs``: the fastest of ``candidates``, where a dearer one (threads over
    inline, processes over threads) must be ``margin`` times faster than the best cheaper one,
    or :data:`STAY` times where both were measured: the margin is the model's uncertainty, which a
    measurement against a measurement does not have, so a run never ends on an executor measured
    slower than another beyond the windows' noise (#59: ``tiny``'s DataLoader stayed inline at
    2.78 ms a batch with processes measured at 2.53).

    Args:
        measured: seconds per element measured on executors already tried; they stand in for
            the predictions.
        current: the executor the stage runs on now: it is left only for a dearer one that is
            ``margin`` times faster than it (``STAY`` where both were measured), or a cheaper one
            :data:`STAY` times faster.
        margin: :data:`MARGIN`; more for a dear move (an interleave's readers: :data:`READERS_MARGIN`).
        move_margin: how much faster any other executor must be to leave ``current`` for it,
            cheaper or dearer, where leaving costs the same either way (None: the rule above).
    """
    measured = measured or {}
    options = [k for k in KINDS if k in candidates and (k != THREAD or costs.thread_safe)]
    if not options:
        raise ValueError(f"no executor to choose from in {candidates!r}")
    miss = model_miss(costs, cores, measured, current)
    seconds = {kind: measured.get(kind, predict(costs, kind, cores) * miss) for kind in options}
    contest = _Contest(seconds, measured, margin, move_margin)
    best = contest.fastest()
    if current is not None and contest.keeps(current, best):
        return current
    return best


def model_miss(
    costs: CallCosts, cores: int, measured: dict[str, float], current: str | None
) -> float:
    """How many times slower than predicted the calls were measured inline, where they run
    inline (``current``), at least 1: an executor not measured is predicted that much slower too.
    What inline's prediction (a call and the consumer's time) leaves out, the others pay as well:
    a machine busier than when the calls were first measured, each element's bookkeeping;
    compared bare with that measurement, a prediction tried executors that could not win
    (``records``' 0.15 ms batches measured 0.18 ms inline, threads predicted 0.15 then measured
    0.44; on a busy machine, inline 0.29 against threads predicted 0.17). A miss on threads or
    processes is theirs (contention, messages) and says nothing of the others; nor does inline
    measured faster than predicted make the others more hopeful."""
    if current != INLINE or current not in measured:
        return 1.0
    predicted = predict(costs, current, cores)
    return max(1.0, measured[current] / predicted) if predicted > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class _Contest:
    """The executors :func:`choose` compares and the margins a win needs (its arguments).

    Attributes:
        seconds: seconds per element of each option (measured, else predicted), cheapest first.
        measured: the executors measured (their margin against each other is :data:`STAY`).
        margin: what a dearer executor must beat a cheaper one by, where not both were measured.
        move_margin: what any executor must beat the current one by (None: the rule above).
    """

    seconds: dict[str, float]
    measured: dict[str, float]
    margin: float
    move_margin: float | None

    def fastest(self) -> str:
        """The fastest option, where a dearer one must beat the best cheaper one by its margin."""
        options = list(self.seconds)
        best = options[0]
        for kind in options[1:]:
            if self.seconds[kind] * self._dearer_needs(kind, best) < self.seconds[best]:
                best = kind
        return best

    def keeps(self, current: str, best: str) -> bool:
        """Whether the calls stay on ``current`` (an option) rather than move to ``best``: a
        dearer one must be its margin faster, a cheaper one :data:`STAY` times (either
        ``move_margin`` where given)."""
        if current not in self.seconds or best == current:
            return False
        dearer = KINDS.index(best) > KINDS.index(current)
        needed = (
            self.move_margin
            if self.move_margin is not None
            else self._dearer_needs(best, current)
            if dearer
            else STAY
        )
        return self.seconds[best] * needed >= self.seconds[current]

    def _dearer_needs(self, kind: str, cheaper: str) -> float:
        """How many times faster ``kind`` must be than ``cheaper``, being dearer."""
        both = self.move_margin is None and kind in self.measured and cheaper in self.measured
        return STAY if both else self.margin


def may_pay(
    kind: str, current: str | None, costs: CallCosts | None, measured: dict[str, float], cores: int
) -> bool:
    """Whether a stage's next pass should keep ``kind`` among its executors, from what its
    earlier passes learned (where its calls ran, their costs, the times measured): yes before
    any decision, where they ran, where measured faster, or where not measured and worth a trial
    (predicted as :meth:`Policy._worth_trying` asks). A pass without worker processes forks
    no zygote (~10 ms to start and stop, and its memory); it asks again at the next pass."""
    if current is None or costs is None or current == kind:
        return True
    here = measured.get(current, predict(costs, current, cores))
    if kind in measured:
        return measured[kind] < here
    return predict(costs, kind, cores) < _TRIED_WITHIN[kind] * here


class Policy:
    """The executor decisions of one stage: the first from measured call costs, then again after
    every window of measurements on the executor it runs on.

    A time measured on an executor (the lower median of its last :data:`WINDOWS_KEPT` windows)
    replaces that executor's prediction. An executor predicted within ``EXPLORE`` of the measured
    one (or faster), but not ``MARGIN`` times faster, is tried once, so a close call is settled by
    measurement rather than by the model. Call costs that change (:meth:`rebase`)
    scale every measurement (or, where the calls now wait where they computed, forget them).

    Args:
        candidates: the executors this stage can run on (in :data:`KINDS`).
        cores: the usable cores.
    """

    def __init__(self, candidates: tuple[str, ...], cores: int) -> None:
        unknown = set(candidates) - set(KINDS)
        if unknown or not candidates:
            raise ValueError(f"executor candidates must be from {KINDS}, got {candidates!r}")
        self.candidates = candidates
        self.cores = cores
        self.costs: CallCosts | None = None
        self.kind: str | None = None
        self._measured: dict[
            str, tuple[float, float]
        ] = {}  # executor -> (seconds per element, when)
        # executor -> its last windows: (seconds per element, whether full: see review)
        self._recent: dict[str, collections.deque[tuple[float, bool]]] = {}
        self._stale_s: dict[
            str, float
        ] = {}  # executor -> how long its measurement stands (STALE_S at first)

    @property
    def measured(self) -> dict[str, float]:
        """Seconds per element measured on each executor tried, lately: within ``STALE_S``, or
        longer for an executor the calls left after measuring it (:meth:`moved`)."""
        now = time.monotonic()
        return {
            kind: seconds
            for kind, (seconds, when) in self._measured.items()
            if now - when < self._stale_s.get(kind, STALE_S)
        }

    def report(self) -> dict[str, Any]:
        """What the policy knows, for ``stats()``: ``measured_s``, each executor's seconds per element
        measured lately, and ``costs``, one call's measured costs (``call_s``, ``cpu_s``,
        ``gil_free``, ``move_s``, ``nbytes``, ``consumer_s``) once the first calls were measured."""
        out: dict[str, Any] = {"measured_s": dict(sorted(self.measured.items()))}
        if self.costs is not None:
            c = self.costs
            out["costs"] = {
                "call_s": c.call_s,
                "cpu_s": c.cpu_s,
                "gil_free": c.gil_free,
                "move_s": c.move_s,
                "nbytes": c.nbytes,
                "consumer_s": c.consumer_s,
            }
        return out

    def decide(self, costs: CallCosts) -> str:
        """The executor for a stage whose calls cost ``costs``; remembers both."""
        self.costs = costs
        self.kind = choose(costs, self.cores, self.candidates, self.measured, self.kind)
        return self.kind

    def rebase(self, costs: CallCosts, scale: float | None = None) -> str:
        """The calls now cost ``costs`` and decide anew. Where the work is of the same kind, only
        ``scale`` times dearer or cheaper (a machine that got busier, larger images), each
        executor's measured time is scaled alike: the ranking measured stands until new windows
        say otherwise (forgotten, the model's prediction had sent ``bigtensor``'s fills back to
        processes, measured slower than inline, every few seconds). ``scale=None`` (the calls
        now wait where they computed, or the reverse): what was measured no longer stands, but
        an executor measured faster than the next one measured is tried again
        (:meth:`_measured_faster`)."""
        if scale is None:  # stale at once: no longer a measurement, but still worth a trial
            self._measured = {
                kind: (seconds, -math.inf) for kind, (seconds, _) in self._measured.items()
            }
        else:
            self._measured = {
                kind: (seconds * scale, when) for kind, (seconds, when) in self._measured.items()
            }
        self._recent.clear()
        self._stale_s.clear()
        return self.decide(costs)

    def moved(self, kind: str) -> None:
        """The calls run on ``kind`` from now on (the caller acted on a verdict). An executor they
        leave after it was measured keeps its measurement twice as long (:data:`STALE_MAX_S`)."""
        if self.kind is not None and kind != self.kind and self.kind in self._measured:
            self._stale_s[self.kind] = min(2 * self._stale_s.get(self.kind, STALE_S), STALE_MAX_S)
        self.kind = kind

    def review(self, seconds_per_element: float, full: bool = True) -> str:
        """The executor after a window on the current one (``kind``), in which the consumer got an
        element every ``seconds_per_element`` (its own work included: that is what executors are
        compared by). The caller moves the calls, and sets ``kind``, when it acts on the verdict.
        A window that is not ``full`` (cut short by the end of a pass) counts as a measurement,
        but only :data:`WINDOWS_KEPT` full ones in a row make a trial worth its cost
        (:meth:`_worth_trying`)."""
        if self.kind is None or self.costs is None:
            raise RuntimeError("Policy.review() before decide()")
        recent = self._recent.setdefault(self.kind, collections.deque(maxlen=WINDOWS_KEPT))
        recent.append((seconds_per_element, full))
        self._measured[self.kind] = (
            statistics.median_low(seconds for seconds, _ in recent),
            time.monotonic(),
        )
        measured = self.measured
        choice = choose(self.costs, self.cores, self.candidates, measured, self.kind)
        if choice == self.kind:
            choice = self._worth_trying(measured) or choice
        elif choice in measured and self._outnumbered(choice, measured):
            choice = self.kind  # measured on fewer windows than `choice`: the trial goes on
        elif choice not in measured and self.lost_big(measured):
            # back first: a trial starts from the best measured
            choice = min(measured, key=measured.__getitem__)
        return choice

    def lost_big(self, measured: dict[str, float]) -> bool:
        """Whether the executor the calls run on measured :data:`LOSES_BIG` times slower than
        another measured lately (a trial that lost: it goes back at once, and the next trial, if
        any, starts from there after as many windows as any: #59, ``records``' calls went from a
        losing window on threads, 2x slower, on to processes, 17x, before coming back)."""
        here = measured.get(self.kind) if self.kind is not None else None
        others = [seconds for kind, seconds in measured.items() if kind != self.kind]
        return here is not None and bool(others) and here > LOSES_BIG * min(others)

    def model_miss(self) -> float:
        """:func:`model_miss` for the calls where they run now."""
        assert self.costs is not None  # decided
        return model_miss(self.costs, self.cores, self.measured, self.kind)

    def slower_than(self) -> float | None:
        """Seconds per element past which a window on the current executor may end early (it
        loses big against the fastest other executor measured lately); None where none was."""
        others = [seconds for kind, seconds in self.measured.items() if kind != self.kind]
        return LOSES_BIG * min(others) if others else None

    def windows(self, kind: str) -> int:
        """How many windows ``kind``'s measurement rests on (at most :data:`WINDOWS_KEPT`)."""
        return len(self._recent.get(kind, ()))

    def _outnumbered(self, other: str, measured: dict[str, float]) -> bool:
        """Whether the executor the calls run on was measured on fewer windows than ``other`` (one
        slow window, a fresh pool warming up, must not end a trial) and is not :data:`LOSES_BIG`
        times slower than it."""
        assert self.kind is not None  # reviewed: a kind was chosen
        fewer = self.windows(self.kind) < self.windows(other)
        return fewer and measured[self.kind] < LOSES_BIG * measured[other]

    def alternative(self) -> str:
        """The best executor other than inline, for a stage asked to run calls in parallel."""
        parallel = tuple(k for k in self.candidates if k != INLINE) or (THREAD,)
        costs = self.costs or CallCosts(1e-3, 1e-3, 0.0, 0.0)
        return choose(costs, self.cores, parallel, self.measured)

    def restore(self, costs: CallCosts, measured: dict[str, float], kind: str) -> None:
        """Go on from what an earlier pass knew (:meth:`snapshot`)."""
        now = time.monotonic()
        self.costs, self.kind = costs, kind
        self._measured = {k: (seconds, now) for k, seconds in measured.items()}
        self._recent = {}

    def _worth_trying(self, measured: dict[str, float]) -> str | None:
        """An executor not measured lately, predicted within ``EXPLORE`` of the current one measured
        (processes; inline within :data:`EXPLORE_INLINE`), or ``EXPLORE`` times faster (threads);
        or threads, not measured lately, whatever their prediction, while the calls run
        on processes, or inline where a call takes :data:`THREAD_TRIAL_S` or more (unless the
        probe saw the GIL free less than :data:`THREAD_TRIAL_FREE` of a call): the GIL probe
        misses releases shorter than its tick (torch ops on fresh tensors ran 1.35x faster on
        threads where it predicted no overlap, and 3.6x faster than inline), and a window on
        threads costs little (a process pool's workers stay up for it: calls come back without a
        fork); but not where threads, predicted as if the GIL were free throughout, would still
        not be ``EXPLORE`` times faster (:meth:`_threads_may_win`): processes that already
        deliver a call's share of the cores leave threads nothing to win. Only after
        :data:`WINDOWS_KEPT` full windows in a row on the current executor: a trial lasts as
        many, and where passes end before a window is full (``blobs``' epochs of 40 ms, each
        judged as one short window) a trial of processes at the 5th cost 115 ms of a run of 200,
        for a prediction that missed by 2.4x."""
        assert self.kind is not None and self.costs is not None  # measured: a kind was chosen
        if not self._windows_full(self.kind):
            # measured on too few windows, or too short ones, to stand against a trial's
            return None
        here = measured[self.kind]
        miss = self.model_miss()
        for kind in self._not_tried(measured):
            if self._measured_faster(kind, here):
                return kind
            if self._threads_missed(kind) and self._threads_may_win(here):
                return kind
            within = (_FROM_INLINE if self.kind == INLINE else _TRIED_WITHIN).get(
                kind, _TRIED_WITHIN[kind]
            )
            if predict(self.costs, kind, self.cores) * miss < within * here:
                return kind
        return None

    def _measured_faster(self, kind: str, here: float) -> bool:
        """Whether ``kind``'s last measurement, stale now (or from before the calls' costs
        changed), was :data:`STAY` times faster than ``here``: it is measured again, whatever the
        model predicts, so a run does not end on an executor slower than one it measured (#59
        item 7: ``tiny``'s and ``bigtensor``'s DataLoader ended inline, processes measured faster
        before their measurement went stale and the model predicted them slower)."""
        last = self._measured.get(kind)
        return last is not None and last[0] * STAY < here

    def _windows_full(self, kind: str) -> bool:
        """Whether ``kind`` was measured on :data:`WINDOWS_KEPT` full windows in a row."""
        recent = self._recent.get(kind, ())
        return len(recent) >= WINDOWS_KEPT and all(full for _, full in recent)

    def _not_tried(self, measured: dict[str, float]) -> list[str]:
        """The candidates not measured lately (threads only for calls that may run on them)."""
        assert self.costs is not None  # measured: a kind was chosen
        thread_safe = self.costs.thread_safe
        return [
            kind
            for kind in KINDS
            if kind in self.candidates and kind not in measured and (kind != THREAD or thread_safe)
        ]

    def _threads_missed(self, kind: str) -> bool:
        """Whether ``kind`` is threads, whose prediction the GIL probe may have missed (it saw the
        GIL free :data:`THREAD_TRIAL_FREE` of a call or more, or the call waits, with the GIL
        free), while the calls run on processes or take :data:`THREAD_TRIAL_S` or more."""
        c = self.costs
        assert c is not None  # measured: a kind was chosen
        if kind != THREAD:
            return False
        waits = 1.0 - c.cpu_s / c.call_s if c.call_s > 0 else 0.0
        may_miss = max(c.gil_free, waits) >= THREAD_TRIAL_FREE
        return may_miss and (self.kind == PROCESS or c.call_s >= THREAD_TRIAL_S)

    def _threads_may_win(self, here: float) -> bool:
        """Whether threads, predicted as if the GIL were free throughout (a release the probe
        missed cannot win more), would be ``EXPLORE`` times faster than ``here``, or than the
        current executor's prediction where it measured slower than that: a machine busier than
        when the calls were measured slows threads alike (``jpeg``'s processes, predicted at 34
        ms a batch as threads were at best, measured 40-49 on a busy day; threads then measured
        54-57, as their prediction with the GIL free 0.67 of a call said)."""
        assert self.costs is not None and self.kind is not None  # measured: a kind was chosen
        best = predict(dataclasses.replace(self.costs, gil_free=1.0), THREAD, self.cores)
        return EXPLORE * best < min(here, predict(self.costs, self.kind, self.cores))

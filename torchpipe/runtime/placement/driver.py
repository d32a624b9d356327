"""The measure-and-move driver: how every stage that moves its work while it runs judges it.

Every such stage goes through one driver, :class:`MoveDriver`, with one set of constants (below):
it cuts what the stage delivers into windows (:class:`Cadence`), judges nothing while a move
settles, acts on a verdict of the policy only once ``agree`` windows in a row gave it, and tells a
workload that changed (:data:`CHANGED`). Its users: a
:class:`~torchpipe.runtime.placement.placement.Placement` (map and the DataLoader), an interleave's
:class:`~torchpipe.ops.interleave.placement.ReaderPlacement` (threads or worker processes) and a
prefetch's :class:`~torchpipe.ops.prefetch.OverlapChoice` (its thread or inline); which placement
is better, given the measurements, is :mod:`~torchpipe.runtime.placement.policy`'s call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torchpipe.runtime.placement.costs import PROCESS

CHANGED = 2.0
"""A cost per element (a call's, a read's, the consumer's own) that grows or shrinks by more than
this factor between windows is another workload: what was measured before no longer counts."""
CHANGED_FLOOR_S = 1e-7
"""Costs below this many seconds are taken as this much when telling a change (timer noise)."""
SETTLE_S = 0.05
"""After a move to inline or threads, seconds during which nothing is judged: threads start,
buffers fill. Each thread's first two results are not judged either (as a worker's: below)."""
SETTLE_PROCESS_S = 0.05
"""The same after a move to worker processes: they fork and fault their rings in. Their first
results are not judged either (:meth:`~torchpipe.runtime.placement.placement.Placement.move`): two a
worker, its first call cold."""
AGREE = 2
"""Windows in a row whose verdicts must agree before work moves: one can mislead (a cold start, a
busy moment)."""
LEAVE = "leave"
"""What a window says of a stage's placement when the policy would move the work elsewhere."""
REBASE = "rebase"
"""The verdict a window gives when the cost per element changed (:data:`CHANGED`): decide afresh."""
EARLY = 0.25
"""A window that loses big (the stage's ``slower_than``) ends once it lasted this share of the
cadence's seconds: a trial of an executor 2-17x slower costs a quarter window, not one (#59)."""
_UNSET = object()


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
READS = Cadence(
    elements=32, seconds=0.05, settle_elements=16, every=16, settle_s=0.3, settle_process_s=0.3
)
"""An interleave's readers: windows of reads, looked at every 16 elements (a look reads the
counters of every reader's calls), judged from 0.3 s after a move: the pool they moved to starts
its reads in flight from the policy's count and fills its read-ahead (``latency``'s processes
measured 76, 679, 57, then 30 us an element in their first windows, 50 ms each, and the readers
went back to threads on it, measured at 22-29)."""
OVERLAP = Cadence(
    elements=16, seconds=0.1, settle_elements=4, agree=1, settle_s=0.0, settle_process_s=0.0
)
"""A prefetch's thread against inline: its elements take microseconds, its thread starts in as
many and its buffer holds two, so it needs no settling, and it acts on one window (trying the
other mode costs one window, and the policy compares measurements with measurements)."""


def cost_changed(now: float, before: float | None) -> bool:
    """Whether a cost per element is another workload's: it moved by more than :data:`CHANGED`."""
    return before is not None and max(now, before) > CHANGED * max(
        min(now, before), CHANGED_FLOOR_S
    )


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
        self._settle = (
            cadence.settle_elements,
            0.0,
        )  # (elements delivered, time) before which nothing is judged
        # (time, count, the stage's look) where the window began
        self._start: tuple[float, int, Any] | None = None
        # the verdict of the last windows, not yet agreed on enough
        self._pending: str | None = None
        self._streak = 0
        # the cost per element of the last window like the one before
        self._base: float | None = None
        self._limit: Any = _UNSET  # the open window's slower_than, asked once a window

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
        self,
        now: float,
        delivered: int,
        look: Callable[[], Any],
        count: int | None = None,
        last: bool = False,
        slower_than: Callable[[], float | None] | None = None,
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
            slower_than: seconds per counted element past which the window loses big (asked
                once a window; None: no such bound): then it is complete once it holds the
                cadence's elements and lasted :data:`EARLY` of its seconds.
        """
        count = delivered if count is None else count
        if self._start is None:
            self._open_once_settled(now, delivered, count, look, last)
            return None
        start, count0, first = self._start
        if not self._complete(now - start, count - count0, last, slower_than):
            if last:
                self._start = None
            return None
        end = look()
        if last:
            self._start = None
        else:
            self._open(now, count, end)
        return first, end, now - start

    def _open(self, now: float, count: int, look: Any) -> None:
        self._start, self._limit = (now, count, look), _UNSET

    def _open_once_settled(
        self, now: float, delivered: int, count: int, look: Callable[[], Any], last: bool
    ) -> None:
        """Open the first window after a move or a pass's start once what it leaves to settle
        was delivered and its settling time passed (not at a pass's last element)."""
        if not last and delivered >= self._settle[0] and now >= self._settle[1]:
            self._open(now, count, look())

    def _complete(
        self,
        seconds: float,
        count: int,
        last: bool,
        slower_than: Callable[[], float | None] | None,
    ) -> bool:
        """Whether the open window, ``count`` counted elements in ``seconds``, is complete: it
        holds the cadence's elements and lasted its seconds, or the pass ends (``last``), or it
        loses big (:meth:`_loses`)."""
        if count < self.cadence.elements:
            return False
        return seconds >= self.cadence.seconds or last or self._loses(seconds, count, slower_than)

    def _loses(
        self, seconds: float, count: int, slower_than: Callable[[], float | None] | None
    ) -> bool:
        """Whether an open window of ``count`` elements in ``seconds`` ends early: it lasted
        :data:`EARLY` of the cadence's seconds, at more than ``slower_than()`` an element."""
        if slower_than is None or seconds < EARLY * self.cadence.seconds:
            return False
        if self._limit is _UNSET:
            self._limit = slower_than()
        return self._limit is not None and seconds > self._limit * count

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

"""``interleave(..., executor="auto")``: which pool the readers read in, threads or worker processes.

Threads cost nothing to start and nothing per element, which suits readers that only wait (on
files, on remote storage) or hand over ready-made tensors. Readers that also parse records in
Python hold the GIL for it, and on threads that work shares one core with the training loop. So
a pass starts on threads and :class:`ReaderPlacement` measures, window after window, what each
element costs its reader (wall and CPU time) and this thread; the runtime's executor policy
(:func:`~torchpipe.runtime.placement.policy.choose`, the rule map and the DataLoader use too) says where the
readers deliver faster, and the interleave moves its readers there (``InterleaveIterator._move``).

Its windows, settling, agreement and change detection are the runtime's one measure-and-move
driver (:class:`~torchpipe.runtime.placement.driver.MoveDriver`, with the cadence
:data:`~torchpipe.runtime.placement.driver.READS`: windows of reads), as for map's calls; what differs is
what it measures and how the readers move, because readers are not calls:

- a Placement moves calls by swapping its dispatcher's executor, and calls in flight finish where
  they are; a reader has an open inner iterator and items read ahead, so a move hands every reader
  over to the other pool with what it read;
- a Placement's first decision comes from calls run inline; readers of slow storage read inline
  would wait one at a time, so readers start on threads and the reads' costs come from the windows
  there (their wall time less their waits for the GIL, which a read in a worker does not pay);
- an inner dataset opened again at its position in the other pool costs, for a stream that
  resumes by reading again from its start (``tp.from_iterable``), what it read so far: the readers
  the consumer took from finish where they are (for at most ``DRAIN_S``, in ``iterator.py``), and
  the windows judge the new pool once they did. And the other pool must be ``READERS_MARGIN``
  (1.5x) faster, whichever way the move goes (not
  ``MARGIN`` one way and no slower the other); measured times stand for the pass (a Placement
  forgets them after 10 s, and would send readers back and forth every 10 s where a prediction
  and a measurement disagree), and a pool's measure is the lower median of several windows (one
  slowed by a busy core moves nothing); no pool is tried on a prediction alone; while one pool is
  unmeasured the verdict compares the prediction for each (what the model misses, an ordered
  interleave waiting on one slow slot, say, it misses on both sides), not a measurement with a
  prediction; and after a move nothing is judged until a full cycle came from the moved readers
  (they re-read to where they were first).

Readers that the first verdict keeps on threads stay there, and the interleave closes the worker
processes' zygote (it holds memory for nothing); readers moved to processes are measured there and
move back when threads delivered 1.5x faster, or when the reads' cost changes and the policy
predicts threads. docs/executors.md states the rule in prose.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque

from torchpipe.core.stats import IteratorStats
from torchpipe.runtime.placement.costs import PROCESS, THREAD, CallCosts
from torchpipe.runtime.placement.driver import READS, REBASE, MoveDriver
from torchpipe.runtime.placement.policy import READERS_MARGIN, choose

_WINDOWS_KEPT = 5  # a pool's measure is the lower median of its last windows,
_WINDOWS_NEEDED = 2  # of at least this many (its first window, cold, not counted)
_BUSIEST = 0.95  # the GIL share readers are taken to use at most (a queue at 1 waits forever)
RECEIVE_S = 5e-6
"""What receiving an element read by a worker costs this process (elements travel in chunks of
many, as columns where they can): measured about 5 us."""


@dataclasses.dataclass(frozen=True)
class _Look:
    """The stage's counters at one moment."""

    time: float
    produced: int
    reads: int
    work_s: float
    cpu_s: float
    inside_s: float  # in the stage's next(), its waits included
    wait_s: float

    @classmethod
    def of(cls, stats: IteratorStats) -> _Look:
        calls = stats.calls
        assert calls is not None  # an interleave's stats count its reads
        _, work_s, cpu_s = calls.totals()
        return cls(
            time.perf_counter(),
            stats.produced,
            calls.items,
            work_s,
            cpu_s,
            stats.wall_s,
            stats.wait_s,
        )


@dataclasses.dataclass(frozen=True)
class Window:
    """What the readers did between two looks.

    Attributes:
        seconds: the window's length.
        elements: elements delivered.
        reads: elements read (delivered or read ahead).
        work_s, cpu_s: the reads' wall and CPU seconds, where they ran.
        own_s: this thread's seconds in the stage outside its waits (taking from readers).
    """

    seconds: float
    elements: int
    reads: int
    work_s: float
    cpu_s: float
    own_s: float

    @classmethod
    def between(cls, start: _Look, end: _Look) -> Window:
        seconds, elements = end.time - start.time, end.produced - start.produced
        inside = end.inside_s - start.inside_s
        own = max(inside - (end.wait_s - start.wait_s), 0.0)
        return cls(
            seconds,
            elements,
            end.reads - start.reads,
            end.work_s - start.work_s,
            end.cpu_s - start.cpu_s,
            own,
        )

    @property
    def per_element(self) -> float:
        """Seconds per element the consumer got."""
        return self.seconds / max(self.elements, 1)


class ReaderPlacement:
    """The pool an interleave's readers read in, from the executor policy's verdicts on windows.

    Args:
        cores: the usable cores.
        most: the reads in flight the user fixed (``num_parallel_calls=N``), None for AUTOTUNE.
    """

    def __init__(self, cores: int, most: int | None) -> None:
        self.kind = THREAD
        self.deciding = True  # no verdict acted on yet
        self.settled = False  # threads for good: the worker processes can go
        self.costs: CallCosts | None = None
        self._cores = cores
        self._most = most
        self._measured: dict[
            str, deque[float]
        ] = {}  # seconds per element of each pool's last windows
        self._cold = True  # the next window is the first on this pool: it does not measure it
        self._wall_per_cpu = 1.0  # a read's wall time over its CPU time, last window
        self._driver = MoveDriver(READS)  # its base cost: CPU seconds per read

    @property
    def check_every(self) -> int:
        """Elements delivered between two looks at the counters (the first look: after these)."""
        return self._driver.cadence.every

    def review(self, stats: IteratorStats) -> str | None:
        """Look at the counters (every ``check_every`` elements): the pool to move the readers
        to, once two windows agree, else None."""
        look = _Look.of(stats)
        done = self._driver.window(look.time, look.produced, lambda: look, count=look.reads)
        if done is None:
            return None
        window = Window.between(done[0], done[1])
        if window.elements <= 0:
            return None
        # a pool's cost is watched for a change once it was measured: the windows right after a
        # move (readers re-read to where they were, workers start) are not a new workload
        measured = self.kind in self._measures()
        if not self.deciding and measured and self._driver.changed(window.cpu_s / window.reads):
            return self._rebase(window)
        verdict = self.verdict(window)
        return None if verdict is None else self._agreed(verdict)

    def verdict(self, window: Window) -> str | None:
        """The pool the policy chooses after ``window``: measured against measured once both
        pools were measured, predicted against predicted until then; either way the other pool
        must be ``READERS_MARGIN`` faster; None until the pool the readers read in was measured
        (no pool is left on the model's word alone). A pool's measure is the lower median of
        its last windows but the first (readers start, read-ahead fills), and needs two of them: one
        window slowed by something else (a busy core, a collection) moves nothing."""
        self.costs = self._costs(window)
        if window.cpu_s > 0:
            self._wall_per_cpu = window.work_s / window.cpu_s
        if not self._cold:
            self._measured.setdefault(self.kind, deque(maxlen=_WINDOWS_KEPT)).append(
                window.per_element
            )
        self._cold = False
        if self.kind not in self._measures():
            return None  # no pool is left before it was measured: its windows are what it did
        return self._choose()

    def _measures(self) -> dict[str, float]:
        """Each pool's measure: the lower median of its last windows, once it has enough."""
        return {
            kind: statistics.median_low(times)
            for kind, times in self._measured.items()
            if len(times) >= _WINDOWS_NEEDED
        }

    def _choose(self) -> str:
        assert self.costs is not None  # set by verdict()
        measured = self._measures()
        return choose(
            self.costs,
            self._cores,
            (THREAD, PROCESS),
            measured if len(measured) > 1 else {},
            current=self.kind,
            margin=READERS_MARGIN,
            move_margin=READERS_MARGIN,
        )

    def workers(self) -> int:
        """Reads in flight to start a pool with: as many as would keep every core busy if reading
        were all there was (the cores x a read's wall time over its CPU time, as last measured)."""
        return max(1, round(self._cores * max(self._wall_per_cpu, 1.0)))

    def moved(self, kind: str, settled_at: int = 0) -> None:
        """The readers now read in ``kind``: judge it from ``settled_at`` elements delivered on (the
        moved readers have opened again and read back to where they were: one full cycle) and
        once it has settled (workers fork, read-ahead fills)."""
        self.kind = kind
        self.deciding = False
        self._cold = True
        self._driver.moved(kind, settled_at, time.perf_counter())

    def settle(self) -> None:
        """Threads for good (the readers cannot travel, or the pass ended before a verdict)."""
        self.deciding = False
        self.settled = self.kind == THREAD

    def _agreed(self, verdict: str) -> str | None:
        if not self._driver.agreed(verdict):
            return None
        if self.deciding and verdict == THREAD:
            self.settle()
        return verdict if verdict != self.kind else None

    def _costs(self, window: Window) -> CallCosts:
        """What a read costs, from ``window``. On threads, a read's CPU time is taken to hold the
        GIL (parsing in Python), and its wall time also holds its waits for the GIL while the other
        readers run: with the readers keeping the GIL busy a share ``u`` of the time, a read waits
        about ``cpu u / (1 - u)`` for it, which a read alone (in a worker) would not. This thread's
        own time per element is the threads' hand-off, and no less on processes. In workers only
        the CPU time says what a read costs (their wall time swings with their threads' GIL)."""
        cpu = window.cpu_s / window.reads
        if self.kind == PROCESS and self.costs is not None:
            share = (
                min(1.0, max(self.costs.cpu_s / self.costs.call_s, 0.05))
                if self.costs.call_s > 0
                else 1.0
            )
            # what taking the workers' elements costs this thread, as measured there
            handoff = window.own_s / window.elements
            return dataclasses.replace(
                self.costs,
                call_s=cpu / share,
                cpu_s=cpu,
                handoff_s=handoff,
                message_s=max(RECEIVE_S, handoff),
            )
        busy = min(window.cpu_s / window.seconds, _BUSIEST) if window.seconds > 0 else _BUSIEST
        alone = max(cpu, window.work_s / window.reads - cpu * busy / (1.0 - busy))
        handoff = window.own_s / window.elements
        return CallCosts(
            alone,
            cpu,
            1.0 - cpu / alone if alone > 0 else 1.0,
            0.0,
            handoff_s=handoff,
            message_s=max(RECEIVE_S, handoff),
            threads_in_workers=True,
            most=self._most,
        )

    def _rebase(self, window: Window) -> str | None:
        """The reads' cost changed: once the next window agrees, forget what was measured and
        predict afresh; the verdict stands at once (two windows agreed on the change)."""
        if not self._driver.agreed(REBASE):
            return None
        self._driver.baseline(window.cpu_s / window.reads)
        self._measured.clear()
        self.costs = self._costs(window)
        verdict = self._choose()
        return verdict if verdict != self.kind else None

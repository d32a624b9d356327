"""The tuner thread of one pipeline pass: look, model, climb, apply; often at first, then less.

Each round takes a look at the counters, builds the model of the window since the last round
(:mod:`torchpipe.autotune.live`), hill-climbs every AUTOTUNE knob from its minimum under the CPU
and RAM budgets (:mod:`torchpipe.autotune.tuner`), and asks the iterators for the new values;
they apply them on their own threads, between two elements. The window in which the pass
starts, the one right after a change, and any in which a stage moved its calls to another
executor (its placement policy's verdict) are not modelled: they hold start-up and transition
(a window half inline and half on threads, modelled as threads throughout, had the tuner add a
third thread to a trial that was 50 ms old).

The model can be wrong where Python is: threads that hold the GIL, cores already busy elsewhere.
So every move is checked against what it bought: if raising knobs did not raise the measured
throughput by at least ``_MIN_GAIN``, they are held at their old values for ``_HOLD_ROUNDS``
rounds (then the model may try again: the workload may have changed); if lowering knobs cost more
than ``_MAX_LOSS`` of it, they go back up and are kept there as long. For the same reason a round
at most doubles or halves a knob: a big step the model got wrong costs one window, not the pass.
And a model that predicts far more than the window measured, at the knobs as they are, misses
what limits the pipeline: it does not lower knobs (budgets still do).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable

from torchpipe.autotune import tunable
from torchpipe.autotune.live import Look, Model, build_model, look, walk_iterators
from torchpipe.autotune.model import Knob, bottleneck, predict_time
from torchpipe.autotune.tuner import Budget, backoff_intervals, hill_climb
from torchpipe.core.iterator import Iterator
from torchpipe.runtime.knob import LiveKnob

_MIN_ELEMENTS, _MIN_WINDOW_S = 8, 0.25  # what a window needs before it is modelled
_MIN_GAIN = 0.03
_MAX_LOSS = 0.1  # a move that lowered knobs and lost more throughput than this is undone
_GROWTH = 2  # a round may at most double a knob, and at most halve it
# A model predicting more than this times the measured rate, at the knobs as they are, misses what
# limits the pipeline (head-of-line blocking in an interleave's order, say): it may raise knobs,
# whose moves are judged, but not lower them.
_UNEXPLAINED = 2.0
_WORK_CHANGE = 1.5  # a window whose work per element moved this much is a new workload: no verdict
_HOLD_ROUNDS = 8
_HISTORY = 64
_FIRST_S, _LAST_S = 0.1, 2.0


class ConsumerClock:
    """Time the training loop spends outside ``next()``: the consumer's own work per element.

    The pipeline's root iterator calls :meth:`enter` and :meth:`leave` around each ``next()``.
    """

    __slots__ = ("_outside_s", "_left_at")

    def __init__(self) -> None:
        self._outside_s = 0.0
        self._left_at: float | None = None

    def enter(self) -> None:
        left_at = self._left_at
        if left_at is not None:
            self._outside_s += time.perf_counter() - left_at
            self._left_at = None

    def leave(self) -> None:
        self._left_at = time.perf_counter()

    def outside_s(self) -> float:
        """Seconds outside ``next()`` so far, the current stretch included."""
        left_at = self._left_at
        return self._outside_s + (time.perf_counter() - left_at if left_at is not None else 0.0)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One round of the tuner.

    Attributes:
        at_s: seconds since the tuner started.
        values: every AUTOTUNE knob's value after the round.
        throughput: root elements per second measured in the window.
        predicted: root elements per second the model predicts with ``values``.
        bottleneck: the stage that limits the line (``consumer`` for the training loop).
        changed: the knobs the round changed.
    """

    at_s: float
    values: dict[str, int]
    throughput: float
    predicted: float
    bottleneck: str
    changed: tuple[str, ...] = ()


def live_knobs(root: Iterator) -> list[LiveKnob]:
    """Every AUTOTUNE knob in the tree under ``root``."""
    return [knob for it, _ in walk_iterators(root) for knob in tunable.knobs(it)]


class Autotuner:
    """Tunes the AUTOTUNE knobs of one iterator tree while it runs.

    Args:
        root: the tree's root iterator.
        clock: the consumer's clock.
        budget: what the pipeline may use.
        intervals: seconds between rounds (default: 0.1 s at first, backing off to 2 s).
    """

    def __init__(
        self,
        root: Iterator,
        clock: ConsumerClock,
        budget: Budget | Callable[[], Budget],
        intervals: Iterable[float] | None = None,
    ) -> None:
        self.root = root
        self.clock = clock
        # or what makes it, asked at the first round (reading the machine costs ~0.3 ms)
        self._budget = budget
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=_HISTORY)
        self._intervals = iter(
            intervals if intervals is not None else backoff_intervals(_FIRST_S, _LAST_S)
        )
        # the first window's look and when its round is due
        self._first: tuple[Look, float] | None = None
        self._live = {knob.name: knob for knob in live_knobs(root)}
        self._held: dict[str, tuple[int, int]] = {}  # knob -> (held value, rounds left): a ceiling
        self._floors: dict[str, tuple[int, int]] = {}  # knob -> (floor value, rounds left)
        self._last_move: tuple[dict[str, int], dict[str, int], float, float] | None = None
        # (raised knobs' old values, lowered knobs' old values, rate, work) of the last round that moved
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.trace: Callable[[Decision], None] | None = None  # a traced pass records every round

    @property
    def knobs_by_name(self) -> dict[str, LiveKnob]:
        """The live knobs it tunes, by name."""
        return dict(self._live)

    @property
    def budget(self) -> Budget:
        """What the pipeline may use."""
        if not isinstance(self._budget, Budget):
            self._budget = self._budget()
        return self._budget

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start tuning now, on a thread of its own: the first window starts here."""
        self._thread = threading.Thread(target=self._run, name="torchpipe-autotune", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        """Called with each element until the tuner runs: the first call starts the first window
        here, and the thread starts when that window's round is due. A pass that ends sooner (a
        small pipeline, an interleave's inner one) starts no thread."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (look(self.root, self.clock.outside_s()), now + next(self._intervals))
        elif now >= self._first[1] and self._thread is None and not self._stop.is_set():
            self.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        due = self._first is not None  # the first window started at tick(); its round is due now
        before = (
            self._first[0] if self._first is not None else look(self.root, self.clock.outside_s())
        )
        settling = True  # the first window holds the start-up
        for interval in itertools.chain([0.0] if due else [], self._intervals):
            if self._stop.wait(interval):
                return
            after = look(self.root, self.clock.outside_s())
            enough = after.produced(self.root) - before.produced(self.root) >= _MIN_ELEMENTS
            if not enough or after.time - before.time < _MIN_WINDOW_S:
                continue  # too little to go on: let the window grow
            if after.moves != before.moves:  # calls moved to another executor in it: two placements
                settling = False
            elif not settling:
                settling = bool(self.step(before, after).changed)
            else:
                settling = False
            before = after

    def step(self, before: Look, after: Look) -> Decision:
        """One round over the window between two looks: model, climb, apply, record."""
        model = build_model(self.root, before, after)
        # A stage's knobs may follow where its calls run (a process map's tasks in flight)
        self._live = {knob.name: knob for knob in live_knobs(self.root)}
        return self.decide(model)

    def decide(self, model: Model) -> Decision:
        """Choose and apply knob values for ``model`` (the part of a round that needs no tree)."""
        work = sum(stage.work_s for stage in model.stages)
        self._judge_last_move(model.throughput, work)
        now = predict_time(model.stages, {k.name: k.value for k in model.knobs})
        may_lower = now <= 0 or 1.0 / now <= _UNEXPLAINED * model.throughput
        knobs = [self._search_range(k, model.tunable, may_lower) for k in model.knobs]
        values = hill_climb(model.stages, knobs, self.budget)
        raised: dict[str, int] = {}
        lowered: dict[str, int] = {}
        changed: list[str] = []
        for name in sorted(model.tunable):
            live = self._live.get(name)
            if live is None or values[name] == live.value:
                continue
            (raised if values[name] > live.value else lowered)[name] = live.value
            live.request(values[name])
            changed.append(name)
        self._last_move = (raised, lowered, model.throughput, work) if changed else None
        predicted = predict_time(model.stages, values)
        decision = Decision(
            at_s=time.perf_counter() - self._started,
            values={name: values[name] for name in sorted(model.tunable)},
            throughput=model.throughput,
            predicted=1.0 / predicted if predicted > 0 else float("inf"),
            bottleneck=bottleneck(model.stages, values),
            changed=tuple(changed),
        )
        self.decisions.append(decision)
        if self.trace is not None:
            self.trace(decision)
        return decision

    def _search_range(self, knob: Knob, tunable_names: set[str], may_lower: bool = True) -> Knob:
        """The knob as the climb sees it: from half its value now (or its floor; its value now
        unless ``may_lower``; lower only if a budget requires it) up to its maximum, twice its
        value now or its held value (a round's step is judged before the next is taken). A knob
        at 0 (calls on the caller's thread) stays there, and one above stays above: moving calls
        between the caller's thread and a pool is the executor policy's decision, by measurement."""
        if knob.name not in tunable_names:
            return knob
        if knob.value == 0:
            return dataclasses.replace(knob, minimum=0, maximum=0)
        held, floor = self._held.get(knob.name), self._floors.get(knob.name)
        maximum = min(knob.maximum, _GROWTH * knob.value)
        maximum = min(maximum, held[0]) if held is not None else maximum
        lowest = -(-knob.value // _GROWTH) if may_lower else knob.value
        start = max(knob.minimum, 1, lowest, floor[0] if floor is not None else 0)
        return dataclasses.replace(
            knob, value=start, minimum=max(knob.minimum, 1), maximum=max(maximum, start)
        )

    def _judge_last_move(self, throughput: float, work: float) -> None:
        """Check what the last move bought: knobs raised for less than ``_MIN_GAIN`` are held at
        their old values (a ceiling), knobs lowered at a loss of more than ``_MAX_LOSS`` go back
        up and stay there (a floor), each for ``_HOLD_ROUNDS`` rounds; count down the holds.

        The model can be wrong both ways where Python is: threads holding the GIL make more of
        them look useful, and a busy CPU makes every stage look slower than it is, so a stage
        that is not the bottleneck can look like one. No verdict when the work per element
        changed (the function got slower or faster): the throughput then says nothing about
        the move."""

        def count_down(holds: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
            return {
                name: (value, rounds - 1) for name, (value, rounds) in holds.items() if rounds > 1
            }

        self._held, self._floors = count_down(self._held), count_down(self._floors)
        if self._last_move is None:
            return
        raised, lowered, before, work_before = self._last_move
        if max(work, work_before) > _WORK_CHANGE * max(min(work, work_before), 1e-12):
            return
        if raised and throughput < before * (1.0 + _MIN_GAIN):
            for name, old in raised.items():
                self._held[name] = (old, _HOLD_ROUNDS)
        if lowered and throughput < before * (1.0 - _MAX_LOSS):
            for name, old in lowered.items():
                self._floors[name] = (old, _HOLD_ROUNDS)

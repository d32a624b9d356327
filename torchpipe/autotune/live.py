"""The model of a running pipeline, built from what its iterators measured between two looks.

A *look* copies every iterator's cumulative counters (and the consumer's clock); the difference
between two looks is what happened in that window. :func:`build_model` turns it into the line of
:class:`~torchpipe.autotune.model.Stage` s that the model predicts from, leaf first, the consumer
last, every time per element of the root (the elements the training loop receives):

- an op on its caller's thread adds its *self time* (its wall time minus its inputs') there;
- an op with a pool (parallel map, parallel interleave) adds a stage of its calls' wall time,
  divided by its parallelism and followed by its in-flight window; its input, pulled on the
  caller's thread, stays with the caller;
- a prefetch ends the segment of its input (which runs on its thread) with its buffer;
- the consumer's stage is the time the training loop spent between two ``next()`` calls.

Time spent waiting on a buffer is never work: it is what the model predicts from the rest.
"""

from __future__ import annotations

import dataclasses
import time

from torchpipe.autotune import tunable
from torchpipe.autotune.model import Knob, Stage
from torchpipe.autotune.tunable import BUFFER, POOL
from torchpipe.core.iterator import Iterator
from torchpipe.runtime.counts import COUNTS

CONSUMER = "consumer"
"""The name of the training loop's stage in the model and the report."""


@dataclasses.dataclass(frozen=True)
class Counters:
    """One iterator's cumulative counters at one look."""

    produced: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    calls: int = 0
    work_s: float = 0.0
    cpu_s: float = 0.0
    bytes_per_element: float = 0.0
    items: int = 0
    delay_s: float = 0.0

    def minus(self, earlier: Counters) -> Counters:
        return Counters(
            self.produced - earlier.produced,
            self.wall_s - earlier.wall_s,
            self.wait_s - earlier.wait_s,
            self.calls - earlier.calls,
            self.work_s - earlier.work_s,
            self.cpu_s - earlier.cpu_s,
            self.bytes_per_element,
            self.items - earlier.items,
            self.delay_s - earlier.delay_s,
        )


@dataclasses.dataclass(frozen=True)
class Look:
    """Every iterator's counters (by ``id``) and the consumer's clock at one moment.

    Attributes:
        time: ``time.perf_counter()`` when taken.
        iterators: counters by ``id(iterator)``.
        consumer_s: seconds the training loop spent outside ``next()`` so far.
        main_cpu_s: CPU seconds of this process (all its threads) so far.
        shared: the counts user functions keep (:mod:`~torchpipe.runtime.counts`: ``tp.image``'s
            decodes), read for the pass's start only (the tuner's looks do not need them).
        moves: how many times the stages moved their calls to another executor so far
            (:meth:`~torchpipe.runtime.knob.LiveKnob.moved`): a window with a move in it measured
            two placements, and is not modelled.
    """

    time: float
    iterators: dict[int, Counters]
    consumer_s: float
    main_cpu_s: float
    shared: dict[str, int] = dataclasses.field(default_factory=dict)
    moves: int = 0

    def produced(self, root: Iterator) -> int:
        return self.iterators.get(id(root), Counters()).produced


def start_look() -> Look:
    """The look before a tree's first element: every counter at zero."""
    return Look(time.perf_counter(), {}, 0.0, time.process_time(), COUNTS.snapshot())


def walk_iterators(root: Iterator) -> list[tuple[Iterator, int]]:
    """``root`` and every iterator below it, depth first, root first, with their depths."""
    out, stack = [], [(root, 0)]
    while stack:
        it, depth = stack.pop()
        out.append((it, depth))
        stack.extend((child, depth + 1) for child in reversed(it.children()))
    return out


def look(root: Iterator, consumer_s: float) -> Look:
    """The counters of ``root`` and every iterator below it, now."""
    counters, moves = {}, 0
    for it, _ in walk_iterators(root):
        moves += sum(knob.moves for knob in tunable.knobs(it))
        stats = it.stats
        calls, work_s, cpu_s = stats.calls.totals() if stats.calls is not None else (0, 0.0, 0.0)
        items, delay_s = (
            (stats.calls.items, stats.calls.delay_s) if stats.calls is not None else (0, 0.0)
        )
        counters[id(it)] = Counters(
            stats.produced,
            stats.wall_s,
            stats.wait_s,
            calls,
            work_s,
            cpu_s,
            stats.bytes_per_element,
            items,
            delay_s,
        )
    return Look(time.perf_counter(), counters, consumer_s, time.process_time(), moves=moves)


def caller_seconds(it: Iterator, counters: Counters, inputs_wall_s: float) -> float:
    """Seconds of ``it``'s own work on its caller's thread: its wall time less its waits and, unless
    its input runs on a thread of its own (a prefetch), its input's wall time."""
    inputs = 0.0 if tunable.role(it) == BUFFER else inputs_wall_s
    return max(counters.wall_s - counters.wait_s - inputs, 0.0)


@dataclasses.dataclass
class Model:
    """The line of stages of one window, its knobs, and what it was measured from.

    Attributes:
        stages: leaf first, the consumer last.
        knobs: every knob the stages name (fixed values have ``minimum == maximum``).
        tunable: the names of the knobs the tuner may change.
        elements: root elements delivered in the window.
        seconds: the window's length.
    """

    stages: list[Stage]
    knobs: list[Knob]
    tunable: set[str]
    elements: int
    seconds: float

    @property
    def throughput(self) -> float:
        """Root elements per second measured in the window."""
        return self.elements / self.seconds if self.seconds > 0 else 0.0


def build_model(root: Iterator, before: Look, after: Look) -> Model:
    """The model of the window between two looks (``after`` later); ``root`` is the tree's root."""
    elements = after.produced(root) - before.produced(root)
    builder = _Builder(before, after, max(elements, 1))
    stages = builder.line(root)
    seconds = after.time - before.time
    consumer_s = after.consumer_s - before.consumer_s
    main_cpu = (after.main_cpu_s - before.main_cpu_s) - builder.main_cpu_s
    consumer_cpu = min(1.0, max(0.0, main_cpu / consumer_s)) if consumer_s > 0 else 0.0
    stages.append(Stage(CONSUMER, consumer_s / max(elements, 1), cpu_fraction=consumer_cpu))
    return Model(stages, list(builder.knobs.values()), builder.tunable, elements, seconds)


class _Builder:
    def __init__(self, before: Look, after: Look, elements: int) -> None:
        self.before, self.after, self.elements = before, after, elements
        self.knobs: dict[str, Knob] = {}
        self.tunable: set[str] = set()
        self.main_cpu_s = 0.0  # CPU of this process already counted in some stage

    def delta(self, it: Iterator) -> Counters:
        now = self.after.iterators.get(id(it), Counters())
        return now.minus(self.before.iterators.get(id(it), Counters()))

    def per_root(self, seconds: float) -> float:
        return max(seconds, 0.0) / self.elements

    def knob(self, it: Iterator, suffix: str, value: int) -> str:
        """The knob named for ``it``: its live knob if tunable, else a fixed one."""
        for live in tunable.knobs(it):
            if live.name.endswith(suffix):
                self.knobs[live.name] = Knob(live.name, live.value, live.minimum, live.maximum)
                self.tunable.add(live.name)
                return live.name
        name = f"{it.name}{suffix}#{id(it)}"
        self.knobs[name] = Knob(name, value, value, value)
        return name

    def line(self, it: Iterator) -> list[Stage]:
        """The stages of ``it`` and everything below it, leaf first."""
        d = self.delta(it)
        below: list[Stage] = []
        inputs_wall = 0.0
        for child in it.children():
            below.extend(self.line(child))
            inputs_wall += self.delta(child).wall_s
        own = caller_seconds(it, d, inputs_wall)
        self.main_cpu_s += own
        mine = Stage(it.name, self.per_root(own))
        if tunable.role(it) == BUFFER:
            depth = self.knob(it, ".buffer_size", max(tunable.buffer_slots(it), 1))
            end = Stage(
                f"{it.name} (producer)", 0.0, buffer=depth, bytes_per_element=d.bytes_per_element
            )
            return below + [end, mine]
        # at 0 calls run here: in its self time
        if tunable.role(it) == POOL and tunable.parallelism(it) > 0:
            return self._pool(it, d, below) + [mine]
        return below + [mine]

    def _pool(self, it: Iterator, d: Counters, below: list[Stage]) -> list[Stage]:
        """A pool stage: its calls in a segment of their own; its input and dispatch on the caller's."""
        parallelism = self.knob(it, ".parallelism", max(tunable.parallelism(it), 1))
        slots = max(1, tunable.buffer_slots(it) // max(tunable.parallelism(it), 1))
        # Worker processes keep ``slots`` tasks each in flight: a knob where the stage has one
        # (a process map's ``in_flight``), held at ``slots`` where it has none.
        local_processes = tunable.calls_in_processes(it) and not tunable.calls_on_cluster(it)
        per_unit = self.knob(it, ".in_flight", slots) if local_processes else None
        cpu_fraction = _cpu_fraction(d)
        # not this machine's cores: the knob's maximum is the cluster's
        if tunable.calls_on_cluster(it):
            cpu_fraction = 0.0
        calls = Stage(
            f"{it.name} (calls)",
            self.per_root(_delivered_work(d)),
            parallelism=parallelism,
            buffer=parallelism,
            cpu_fraction=cpu_fraction,
            bytes_per_element=d.bytes_per_element,
            slots_per_unit=slots,
            per_unit=per_unit,
        )
        if not tunable.calls_in_processes(it):
            self.main_cpu_s += d.cpu_s
        cut = _after_last_buffer(below)
        return below[:cut] + [calls] + below[cut:]


def _cpu_fraction(d: Counters) -> float:
    """The share of a core each call in flight wants: the time it ran, and of the time it waited
    for a core others held, the share it would have run (its CPU time over its time not spent
    waiting for a core).

    By CPU time alone, calls slowed by a busy machine would seem to wait on I/O, and a worker past
    the cores would seem to fit the budget: a call that computes throughout wanted a core all the
    time it waited. A read that mostly sleeps on storage waits for a core only at its wake-ups, a
    small part of its time: counted whole, that wait (the busier the machine, the longer) read as
    a core wanted for most of the read, and the reads kept in flight stayed far below what hides
    the storage's latency with the cores half idle (``latency``: 15 reads in flight, where 32 ran
    1.6x faster).
    """
    if d.work_s <= 0:
        return 1.0
    running = d.work_s - d.delay_s
    computing = min(1.0, d.cpu_s / running) if running > 0 else 1.0
    return min(1.0, (d.cpu_s + d.delay_s * computing) / d.work_s)


def _delivered_work(d: Counters) -> float:
    """The calls' seconds of work for the elements delivered in the window.

    Where the stage counts the elements its calls read (interleaves), the window's work is
    scaled from the elements read to those delivered: readers that fill their read-ahead (or
    a burst served from it) would otherwise make each delivered element look dearer (cheaper).
    """
    if d.items <= 0 or d.produced <= 0:
        return d.work_s
    return d.work_s * d.produced / d.items


def _after_last_buffer(stages: list[Stage]) -> int:
    """Index just past the last stage followed by a buffer (0 if none)."""
    for index in range(len(stages) - 1, -1, -1):
        if stages[index].buffer is not None:
            return index + 1
    return 0

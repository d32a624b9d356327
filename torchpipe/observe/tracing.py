"""What a traced pass records: spans on tracks, counters and instants, on ``time.perf_counter``'s clock.

A pass built with ``tp.Options(trace=True)`` has one :class:`TraceLog`. Each stage, each thread or
worker process that runs a stage's calls, and the training loop get a :class:`Track`; recording
is an append of a tuple to one bounded deque (atomic under the GIL, so producer threads need no
lock), and nothing at all is recorded when tracing is off: the hooks are one ``is not None``
test on paths that already read the clock. ``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, one
clock for every process, so a worker's call times line up with the main process's.

The export to Chrome / Perfetto JSON and the timeline plot are in ``torchpipe/integrations``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

MAX_EVENTS = 500_000
"""Events a pass keeps (about 60 MB at most); past it the oldest are dropped and the export says so."""

SPAN, COUNTER, INSTANT = 0, 1, 2
CONSUMER, STAGE, CALLS, TUNER = "consumer", "stage", "calls", "autotune"
"""Track groups: the training loop, a stage's ``next()`` calls, the calls a pool ran, tuner rounds."""


@dataclasses.dataclass(frozen=True)
class TrackInfo:
    """A track: what it shows and where it goes in a picture.

    Attributes:
        id: its number in the events.
        name: e.g. ``map(decode)`` or ``map(decode) worker 1 (pid 4242)``.
        group: ``consumer``, ``stage``, ``calls`` or ``autotune``.
        order: sorts tracks of a group (a stage's place in the tree, root first).
        pid: the process whose thread or worker it is.
        label: what its spans are called (the stage's name; ``waiting for data`` for the loop).
    """

    id: int
    name: str
    group: str
    order: tuple[Any, ...]
    pid: int
    label: str


@dataclasses.dataclass(frozen=True)
class TraceSnapshot:
    """The events of a pass so far, as plain data (``TraceLog.snapshot()``).

    Attributes:
        start: the pass's start on the ``perf_counter`` clock; events' times are on that clock.
        end: when the snapshot was taken.
        tracks: by id.
        events: ``(kind, track id or counter name, time, end or value, name, args)`` in the order
            recorded: spans ``(SPAN, track, t0, t1, None, None)``, counters
            ``(COUNTER, name, t, value, None, None)``, instants ``(INSTANT, track, t, t, name, args)``.
        truncated: the log was full: events older than the first one kept were dropped.
        every_element: whether every element of every stage was recorded (``trace="all"``) or,
            of elements cheaper than 20 us, one in about 16 (the ones the stats clock).
        pid: the main process.
    """

    start: float
    end: float
    tracks: dict[int, TrackInfo]
    events: list[tuple[Any, ...]]
    truncated: bool
    every_element: bool
    pid: int


class Track:
    """One track of a :class:`TraceLog`; ``span`` and ``counter`` are what the hot paths call."""

    __slots__ = ("id", "_append", "_counter")

    def __init__(
        self, track_id: int, append: Callable[[tuple[Any, ...]], None], counter: str
    ) -> None:
        self.id = track_id
        self._append = append
        self._counter = counter

    def span(self, t0: float, t1: float) -> None:
        self._append((SPAN, self.id, t0, t1, None, None))

    def counter(self, value: float) -> None:
        """A value of this track's counter (a buffer's occupancy), now."""
        self._append((COUNTER, self._counter, time.perf_counter(), value, None, None))


class TraceLog:
    """The events of one traced pass.

    Args:
        every_element: record every element of every stage (``Options(trace="all")``) instead of
            the elements the stats clock.
        limit: events kept (the oldest go first).
    """

    def __init__(self, every_element: bool = False, limit: int = MAX_EVENTS) -> None:
        self.start = time.perf_counter()
        self.every_element = every_element
        self._events: deque[tuple[Any, ...]] = deque(maxlen=limit)
        self._append = self._events.append  # a C call: the cheapest record there is
        self._lock = threading.Lock()
        self._tracks: dict[Any, Track] = {}
        self._info: dict[int, TrackInfo] = {}
        self.consumer = self.track(
            (CONSUMER,), "training loop", CONSUMER, (), label="waiting for data"
        )

    def track(
        self,
        key: Any,
        name: str,
        group: str,
        order: tuple[Any, ...],
        pid: int | None = None,
        label: str | None = None,
    ) -> Track:
        """The track for ``key`` (made on first use; a name taken already gets `` #2``)."""
        with self._lock:
            found = self._tracks.get(key)
            if found is not None:
                return found
            taken = {info.name for info in self._info.values()}
            shown, n = name, 1
            while shown in taken:
                n += 1
                shown = f"{name} #{n}"
            track = Track(len(self._tracks), self._append, f"{shown} buffer")
            self._tracks[key] = track
            self._info[track.id] = TrackInfo(
                track.id, shown, group, order, os.getpid() if pid is None else pid, label or shown
            )
            return track

    def counter(self, name: str, value: float) -> None:
        """A value of the counter ``name`` (a knob), now."""
        self._append((COUNTER, name, time.perf_counter(), value, None, None))

    def instant(self, track: Track, name: str, args: dict[str, Any]) -> None:
        now = time.perf_counter()
        self._append((INSTANT, track.id, now, now, name, args))

    def calls(self, stage: str, order: tuple[Any, ...]) -> CallTracer:
        """What a stage's :class:`~torchpipe.runtime.timing.CallTiming` records its calls with."""
        return CallTracer(self, stage, order)

    def snapshot(self) -> TraceSnapshot:
        with self._lock:
            info = dict(self._info)
        events = list(self._events)
        truncated = len(events) >= (self._events.maxlen or len(events) + 1)
        return TraceSnapshot(
            self.start,
            time.perf_counter(),
            info,
            events,
            truncated,
            self.every_element,
            os.getpid(),
        )


class CallTracer:
    """Records the calls of one stage's pool, a track per thread or worker process that ran them.

    Args:
        log: the pass's log.
        stage: the stage's name.
        order: the stage's place in the tree.
    """

    __slots__ = ("_log", "_stage", "_order", "_tracks")

    def __init__(self, log: TraceLog, stage: str, order: tuple[Any, ...]) -> None:
        self._log, self._stage, self._order = log, stage, order
        self._tracks: dict[Any, Track] = {}

    def call(self, wall_s: float, start: float | None, where: str | None, pid: int | None) -> None:
        """A call of ``wall_s`` seconds that began at ``start`` in ``where`` (a worker), or that
        ran on the current thread and just returned (``start`` None)."""
        if start is None:
            start = time.perf_counter() - wall_s
            where = threading.current_thread().name
        track = self._tracks.get(where)
        if track is None:
            shown = (
                where
                if pid is not None
                else f"thread {cast(str, where).removeprefix(self._stage + '-')}"
            )
            name = f"{self._stage} on {shown}"
            track = self._log.track(
                (CALLS, self._stage, where), name, CALLS, self._order, pid, self._stage
            )
            self._tracks[where] = track
        track.span(start, start + wall_s)

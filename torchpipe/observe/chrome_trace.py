"""A traced pass as a Chrome trace / Perfetto JSON file (``it.trace(path)``).

The file is the Trace Event Format that ``ui.perfetto.dev`` and ``chrome://tracing`` open: a
process for the pipeline (and one for each worker process), a thread track for the training loop,
one for each stage and one for each thread or worker that ran a stage's calls, complete events
(``"ph": "X"``, microseconds from the pass's start) for every recorded element and call, counter
events (``"C"``) for buffer occupancy and knob values, instant events (``"i"``) for the tuner's
rounds, and metadata events (``"M"``) that name and order the tracks. Spans that overlap on one
track (the readers an interleave runs at once share their stage's track) are spread over extra
lanes, since a track's complete events must nest.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

from torchpipe.observe.tracing import (
    CALLS,
    CONSUMER,
    COUNTER,
    INSTANT,
    SPAN,
    STAGE,
    TraceSnapshot,
    TrackInfo,
)

_GROUP_RANK = {CONSUMER: 0, STAGE: 1, CALLS: 2}


def write_chrome_trace(snapshot: TraceSnapshot, path: str | os.PathLike) -> None:
    """Write :func:`chrome_trace` of ``snapshot`` to ``path`` (JSON)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(snapshot), f, separators=(",", ":"))


def ordered_tracks(snapshot: TraceSnapshot) -> list[TrackInfo]:
    """The tracks as a picture shows them: the training loop, then each stage (root first) followed
    by the threads and workers that ran its calls, then the tuner."""
    return sorted(
        snapshot.tracks.values(),
        key=lambda t: (t.group not in _GROUP_RANK, t.order, _GROUP_RANK.get(t.group, 3), t.name),
    )


def chrome_trace(snapshot: TraceSnapshot) -> dict[str, Any]:
    """The trace as Trace Event Format JSON data."""
    spans, events = _spans_and_counters(snapshot)
    tids = _thread_events(snapshot, spans, events)
    events.extend(_instant_events(snapshot, tids))
    events.extend(_process_events(snapshot))
    other = {
        "torchpipe_detail": "every element"
        if snapshot.every_element
        else "elements the stats clock",
        "truncated": snapshot.truncated,
        "seconds": snapshot.end - snapshot.start,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _ns(t: float, start: float) -> int:
    """``t`` in whole nanoseconds since ``start``: a span's end and the next one's start compare
    exactly."""
    return round((t - start) * 1e9)


def _spans_and_counters(
    snapshot: TraceSnapshot,
) -> tuple[dict[int, list[tuple[int, int]]], list[dict[str, Any]]]:
    """The spans by track (in ns since the start), and the counter events."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    counters: list[dict[str, Any]] = []
    start = snapshot.start
    for kind, track, t0, t1, _name, _args in snapshot.events:
        if kind == SPAN:
            spans[track].append((_ns(t0, start), _ns(t1, start)))
        elif kind == COUNTER:
            counters.append(
                {
                    "name": track,
                    "ph": "C",
                    "ts": _ns(t0, start) / 1000,
                    "pid": snapshot.pid,
                    "args": {"value": t1},
                }
            )
    return spans, counters


def _instant_events(snapshot: TraceSnapshot, tids: dict[int, int]) -> list[dict[str, Any]]:
    """The tuner's rounds, each on its track's first thread (``tids``)."""
    return [
        {
            "name": name,
            "ph": "i",
            "s": "t",
            "ts": _ns(t0, snapshot.start) / 1000,
            "pid": snapshot.tracks[track].pid,
            "tid": tids[track],
            "args": args or {},
        }
        for kind, track, t0, _, name, args in snapshot.events
        if kind == INSTANT
    ]


def _thread_events(
    snapshot: TraceSnapshot, spans: dict[int, list[tuple[int, int]]], out: list[dict[str, Any]]
) -> dict[int, int]:
    """Metadata and complete events of every track; returns each track's first thread id."""
    tids: dict[int, int] = {}
    next_tid = 1
    for rank, info in enumerate(ordered_tracks(snapshot)):
        lanes = pack_lanes(sorted(spans.get(info.id, [])))
        tids[info.id] = next_tid
        for lane, lane_spans in enumerate(lanes or [[]]):
            name = info.name if lane == 0 else f"{info.name} ({lane + 1})"
            out.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": info.pid,
                    "tid": next_tid,
                    "args": {"name": name},
                }
            )
            out.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": info.pid,
                    "tid": next_tid,
                    "args": {"sort_index": rank * 100 + lane},
                }
            )
            out.extend(_spans(info, lane_spans, next_tid))
            next_tid += 1
    return tids


def _spans(info: TrackInfo, spans: list[tuple[int, int]], tid: int) -> list[dict[str, Any]]:
    """Complete events of one lane (times in ns); the training loop's gaps are its steps."""
    out = []
    previous = None
    for t0, t1 in spans:
        if info.group == CONSUMER and previous is not None and t0 > previous:
            out.append(
                {
                    "name": "training step",
                    "cat": CONSUMER,
                    "ph": "X",
                    "ts": previous / 1000,
                    "dur": (t0 - previous) / 1000,
                    "pid": info.pid,
                    "tid": tid,
                }
            )
        out.append(
            {
                "name": info.label,
                "cat": info.group,
                "ph": "X",
                "ts": t0 / 1000,
                "dur": (t1 - t0) / 1000,
                "pid": info.pid,
                "tid": tid,
            }
        )
        previous = t1
    return out


def pack_lanes(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Sorted spans spread over as few lanes as keep each lane's spans apart (first fit)."""
    lanes: list[list[tuple[int, int]]] = []
    for t0, t1 in spans:
        for lane in lanes:
            if lane[-1][1] <= t0:
                lane.append((t0, t1))
                break
        else:
            lanes.append([(t0, t1)])
    return lanes


def _process_events(snapshot: TraceSnapshot) -> list[dict[str, Any]]:
    names = {snapshot.pid: f"torchpipe pass (pid {snapshot.pid})"}
    for info in snapshot.tracks.values():
        if info.pid not in names:
            names[info.pid] = f"{info.label} worker (pid {info.pid})"
    out = []
    for rank, (pid, name) in enumerate(names.items()):
        out.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
        )
        out.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
    return out

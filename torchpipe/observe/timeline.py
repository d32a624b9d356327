"""A traced pass as a timeline PNG (``it.stats().plot(path)``), in the style of the tf.data
performance guide's figures: time runs left to right, a row per track (the training loop, each
stage root first, each thread or worker process that ran a stage's calls), a bar for each element
a stage produced or call a pool ran, and the training loop's waits for data in red between its
steps. Below, buffer occupancy and knob values over the same time axis, with the tuner's rounds
as dotted lines. Needs matplotlib (``pip install 'torchpipe[plot]'``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from torchpipe.observe.chrome_trace import ordered_tracks
from torchpipe.observe.tracing import CALLS, CONSUMER, COUNTER, INSTANT, SPAN, TraceSnapshot

WIDTH_IN, DPI = 14.0, 100
MAX_BARS = 5000
"""Bars a row draws one by one; a row with more joins those less than a pixel apart."""
_WAIT, _STEP = "#d62728", "#b5e0b5"
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "plotting a timeline needs matplotlib: pip install 'torchpipe[plot]'"
        ) from e
    return plt


def merge_spans(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Sorted spans with those less than ``gap`` apart joined: a picture cannot show them apart,
    and a few hundred thousand bars would take minutes to draw."""
    merged: list[tuple[float, float]] = []
    for t0, t1 in sorted(spans):
        if merged and t0 - merged[-1][1] < gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], t1))
        else:
            merged.append((t0, t1))
    return merged


def plot_timeline(
    snapshot: TraceSnapshot, path: str | os.PathLike, title: str = "torchpipe timeline"
) -> None:
    """Draw ``snapshot`` to the PNG ``path``.

    Raises:
        ImportError: if matplotlib is missing (naming the ``plot`` extra).
    """
    plt = _pyplot()
    spans, counters, rounds = _series(snapshot)
    tracks = [info for info in ordered_tracks(snapshot) if info.id in spans]
    seconds = max(snapshot.end - snapshot.start, 1e-6)
    rows = max(len(tracks), 1)
    fig, (ax, bottom) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(WIDTH_IN, 1.2 + 0.38 * rows + 2.0),
        dpi=DPI,
        gridspec_kw={"height_ratios": [0.38 * rows + 0.4, 2.0]},
    )
    _plot_tracks(ax, tracks, spans, seconds)
    ax.set_title(
        title + ("" if snapshot.every_element else "  (cheap elements sampled, about 1 in 16)"),
        fontsize=10,
    )
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax.grid(axis="x", alpha=0.3)
    _plot_counters(bottom, counters, rounds, seconds)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_tracks(
    ax: Any, tracks: list[Any], spans: dict[int, list[tuple[float, float]]], seconds: float
) -> None:
    """A row of bars per track, the first at the top."""
    rows = max(len(tracks), 1)
    gap = seconds / (WIDTH_IN * DPI)  # one pixel
    colors = _stage_colors(tracks)
    for row, info in enumerate(tracks):
        y = rows - 1 - row
        shown = (
            spans[info.id] if len(spans[info.id]) <= MAX_BARS else merge_spans(spans[info.id], gap)
        )
        # at least a pixel: a 1 us element still shows
        bars = [(t0, max(t1 - t0, gap)) for t0, t1 in shown]
        if info.group == CONSUMER:
            ax.broken_barh(
                [(0.0, seconds)], (y - 0.35, 0.7), facecolors=_STEP, label="training step"
            )
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=_WAIT, label="waiting for data")
        else:
            ax.broken_barh(
                bars,
                (y - 0.35, 0.7),
                facecolors=colors[info.label],
                edgecolors="white",
                linewidth=0.4,
                alpha=0.85 if info.group == CALLS else 1,
            )
    ax.set_yticks(range(rows))
    ax.set_yticklabels([_row_label(info) for info in reversed(tracks)], fontsize=8)
    ax.set_ylim(-0.6, rows - 0.4)


def _series(snapshot: TraceSnapshot) -> tuple[dict[int, list], dict[str, list], list[float]]:
    """Spans by track, counter points by name and the tuner's rounds, in seconds from the start."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    counters: dict[str, list[tuple[float, float]]] = defaultdict(list)
    rounds = []
    for kind, track, t0, t1, _, _ in snapshot.events:
        if kind == SPAN:
            spans[track].append((t0 - snapshot.start, t1 - snapshot.start))
        elif kind == COUNTER:
            counters[track].append((t0 - snapshot.start, t1))
        elif kind == INSTANT:
            rounds.append(t0 - snapshot.start)
    return spans, counters, rounds


def _stage_colors(tracks: list[Any]) -> dict[str, str]:
    labels = list(dict.fromkeys(info.label for info in tracks if info.group != CONSUMER))
    return {label: _PALETTE[i % len(_PALETTE)] for i, label in enumerate(labels)}


def _row_label(info: Any) -> str:
    name = info.name if info.group != CALLS else "  " + info.name
    return name if len(name) <= 48 else name[:45] + "..."


def _plot_counters(
    ax: Any, counters: dict[str, list[tuple[float, float]]], rounds: list[float], seconds: float
) -> None:
    for name, points in sorted(counters.items()):
        points.sort()
        times = [t for t, _ in points] + [seconds]
        values = [v for _, v in points] + [points[-1][1]]
        ax.step(times, values, where="post", label=name, linewidth=1.2)
    for t in rounds:
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlim(0, seconds)
    ax.set_xlabel("seconds since the pass started")
    ax.set_ylabel("buffer fill / knob value", fontsize=8)
    if counters:
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)

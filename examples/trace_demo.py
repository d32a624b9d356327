"""Trace a real pipeline and draw what it did: the pictures in docs/observability.md.

A JPEG pipeline (the benchmark's ``jpeg`` work: Pillow decode, random 224 crop, random flip) with
``tp.AUTOTUNE`` everywhere feeds a loop whose step takes 6 ms, traced with
``tp.Options(trace=True)``. It writes:

- ``trace.json``: ``it.trace(path)``, the Chrome trace / Perfetto JSON (open it in ui.perfetto.dev);
- ``timeline.png``: ``it.stats().plot(path)``;
- ``trace_rendered.png``: a drawing of ``trace.json`` made from the JSON alone, a row per thread
  track grouped by process and a panel per counter, as Perfetto lays a trace out. It is not a
  Perfetto screenshot (there is no browser here); it shows what the file holds.

Run: python examples/trace_demo.py [--out docs/img] [--images 768]  (needs the plot extra)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench import data
from bench.workloads import JpegSample


def run(out: str, images: int) -> None:
    paths = data.jpeg_files(256)
    ds = (
        tp.from_dataset(range(images))
        .map(JpegSample(paths), num_parallel_calls=tp.AUTOTUNE)
        .batch(16)
        .prefetch(tp.AUTOTUNE)
        .with_options(tp.Options(trace=True, seed=0))
    )
    with iter(ds) as it:
        for _ in it:
            # the training step: faster than the pipeline, which is then the limit
            time.sleep(0.006)
        it.trace(os.path.join(out, "trace.json"))
        stats = it.stats()
        stats.plot(os.path.join(out, "timeline.png"))
    print(stats)


def render_chrome_trace(trace_path: str, png_path: str) -> None:
    """Draw a Chrome trace JSON file as Perfetto lays it out, from the file alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        names, order, spans, counters, processes = _parse(json.load(f)["traceEvents"])
    main = min(processes, key=lambda p: 0 if processes[p].startswith("torchpipe pass") else 1)
    rows = sorted(names, key=lambda k: (k[0] != main, k[0], order.get(k, 0)))
    end = max(t + d for lane in spans.values() for t, d, _ in lane)
    height = 0.34 * len(rows) + 1.3 * len(counters) + 1.2
    ratios = [0.34 * len(rows) + 0.6] + [1.0] * len(counters)
    fig, axes = plt.subplots(
        1 + len(counters),
        1,
        sharex=True,
        dpi=100,
        figsize=(14, height),
        gridspec_kw={"height_ratios": ratios},
    )
    ax = axes[0]
    palette = plt.get_cmap("tab10")
    colors: dict[str, Any] = {}
    for row, key in enumerate(rows):
        for t, d, name in spans.get(key, []):
            color = (
                "#d62728"
                if name == "waiting for data"
                else "#b5e0b5"
                if name == "training step"
                else colors.setdefault(name, palette(len(colors) % 10))
            )
            ax.broken_barh(
                [(t, d)],
                (len(rows) - 1 - row - 0.38, 0.76),
                facecolors=color,
                edgecolors="white",
                linewidth=0.3,
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(
        [f"{processes.get(k[0], k[0])} | {names[k]}"[:90] for k in reversed(rows)], fontsize=7
    )
    ax.set_title(
        "Rendered from trace.json by examples/trace_demo.py, not a Perfetto screenshot:\n"
        "each thread track of the Chrome trace a row (process | thread), each complete event a bar, each "
        "counter a panel",
        fontsize=9,
    )
    for cax, (name, points) in zip(axes[1:], sorted(counters.items())):
        points.sort()
        cax.step(
            [t for t, _ in points] + [end], [v for _, v in points] + [points[-1][1]], where="post"
        )
        cax.set_ylabel(name, fontsize=7, rotation=0, ha="right")
    axes[-1].set_xlim(0, end)
    axes[-1].set_xlabel("seconds (ts / 1e6)")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def _parse(events: list[dict[str, Any]]) -> tuple[dict, dict, dict, dict, dict]:
    """Thread names and sort order, spans by thread, counter points and process names of a trace."""
    names, order, spans, counters = {}, {}, defaultdict(list), defaultdict(list)
    processes = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["pid"], e["tid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_sort_index":
            order[e["pid"], e["tid"]] = e["args"]["sort_index"]
        elif e["ph"] == "M" and e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "X":
            spans[e["pid"], e["tid"]].append((e["ts"] / 1e6, e["dur"] / 1e6, e["name"]))
        elif e["ph"] == "C":
            counters[e["name"]].append((e["ts"] / 1e6, e["args"]["value"]))
    return names, order, spans, counters, processes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="docs/img")
    parser.add_argument("--images", type=int, default=768)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    run(args.out, args.images)
    render_chrome_trace(
        os.path.join(args.out, "trace.json"), os.path.join(args.out, "trace_rendered.png")
    )
    print(f"wrote {args.out}/trace.json, timeline.png and trace_rendered.png")


if __name__ == "__main__":
    main()

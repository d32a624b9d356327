"""A grouped bar chart of a ``bench/run.py`` JSON: each configuration's throughput / dataloader_best,
the peers' included.

matplotlib is optional (``pip install matplotlib``); it is imported only here, when plotting.

Run: python bench/plot.py results.json -o ratios.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.run import ORDER
from bench.targets import ZERO_KNOB

BASELINE = "dataloader_best"
PEER_PREFIXES = ("nodes", "spdl", "grain", "tfdata")


def ratios(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """workload -> configuration -> throughput / dataloader_best's (workloads without it skipped)."""
    out = {}
    for name, entry in report["workloads"].items():
        results = entry["results"]
        if BASELINE not in results:
            continue
        base = results[BASELINE]["throughput"]
        out[name] = {config: r["throughput"] / base for config, r in results.items()}
    return out


def _pyplot() -> Any:
    """matplotlib.pyplot on a non-interactive backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(table: dict[str, dict[str, float]], title: str, out: str, plt: Any) -> None:
    """One group of bars per workload, one bar per configuration, a line at 1.0 (DataLoader's best).

    Zero-knob configurations (what a user gets without tuning: torchpipe's two and tf.data's
    AUTOTUNE) are hatched; the peers' bars are edged in black. A configuration a workload did not
    measure has no bar there.
    """
    configs = sorted(
        {c for row in table.values() for c in row}, key=lambda c: (ORDER + (c,)).index(c)
    )
    workloads = list(table)
    width = 0.8 / max(len(configs), 1)
    # wide enough for every bar of a group to stay visible, plus the legend's column
    fig, ax = plt.subplots(
        figsize=(max(6.0, 0.13 * len(configs) * len(workloads) + 1.0) + 2.4, 4.6)
    )
    colors = plt.get_cmap("tab20").colors  # one colour each: tab10 repeats after ten configurations
    for k, config in enumerate(configs):
        xs = [i + (k - (len(configs) - 1) / 2) * width for i in range(len(workloads))]
        present = [(x, table[w][config]) for x, w in zip(xs, workloads) if config in table[w]]
        peer = config.split("_")[0] in PEER_PREFIXES
        ax.bar(
            [x for x, _ in present],
            [r for _, r in present],
            width,
            label=config,
            color=colors[k % len(colors)],
            hatch="//" if config in ZERO_KNOB + ("tfdata_autotune",) else None,
            edgecolor="black" if peer else None,
            linewidth=0.6 if peer else 0,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("throughput / dataloader_best")
    ax.set_yscale("log")
    from matplotlib.ticker import (
        FuncFormatter,
        LogLocator,
        NullFormatter,
    )  # only with matplotlib installed

    # labels at 1, 2 and 5 of each decade; the other minor ticks unlabelled (they overlapped)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_title(title)
    ax.legend(
        fontsize=7,
        title="hatched: no knobs",
        title_fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )  # beside the bars, not over them
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench/run.py --json output")
    parser.add_argument("-o", "--output", default="bench.png", help="the image to write")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        report = json.load(f)
    plt = _pyplot()
    if plt is None:
        sys.exit("bench/plot.py needs matplotlib, an optional extra: pip install matplotlib")
    machine = report.get("machine", {})
    title = f"torchpipe vs DataLoader and the peers ({machine.get('usable_cores', '?')} cores, higher is better)"
    draw(ratios(report), title, args.output, plt)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Markdown tables from a ``bench/run.py`` JSON: the README's summary, every row, the targets.

The summary (README.md) is one row per workload: torch's best DataLoader, the two zero-knob
configurations and the best Python peer, as ratios to torch's. The full table and the targets
table go with the run's section in bench/RESULTS.md. From a ``bench/run.py --repeat N`` run every
number is a median of N runs and ratios are ratios of medians; each is followed by its spread,
``(max - min) / median`` of its runs' throughputs.

Run: python bench/markdown.py docs/img/bench_quick.json [--table summary|results|targets|all]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.run import ORDER
from bench.targets import PEER_BESTS, describe, reported

BASELINE = "dataloader_best"
ZERO_KNOB = ("torchpipe_auto", "torchpipe_dataloader_auto")
PEER_NAMES = {
    "nodes_best": "torchdata.nodes",
    "spdl_best": "SPDL",
    "grain_best": "Grain",
    "tfdata_best": "tf.data",
}
TABLES = ("summary", "results", "targets")


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def results_table(report: dict[str, Any]) -> str:
    """One row per workload and configuration, in ``bench/run.py``'s order."""
    lines = [
        "| workload | configuration | throughput | spread | vs dataloader_best | floor | vs limit | first batch "
        "| converge_s | peak held | end PSS | CPU per item | others |",
        "|---" * 13 + "|",
    ]
    for name, entry in report["workloads"].items():
        results, limit, unit = entry["results"], entry["limit"], entry["unit"]
        base = results.get(BASELINE, {}).get("throughput")
        noise = (entry.get("floor") or {}).get("ratio")
        for config in sorted(results, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
            r = results[config]
            share, converge = r.get("others_cpu_share"), r.get("converge_s")
            cells = [
                name,
                config,
                f"{r['throughput']:.4g} {unit}",
                _spread(r) or "-",
                f"{r['throughput'] / base:.2f}x" if base else "-",
                "-" if noise is None else f"{noise:.2f}",
                f"{r['throughput'] / limit:.2f}" if limit else "-",
                f"{r['first_batch_s']:.2f} s",
                "-" if converge is None else f"{converge:.2f} s",
                _megabytes(r.get("peak_held_mb")),
                _megabytes(r.get("end_pss_mb")),
                f"{r['cpu_s_per_item'] * 1e3:.3f} ms",
                "-" if share is None else f"{share:.0%}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(result: dict[str, Any]) -> str:
    """A result's spread, ``(max - min) / median`` of its runs' throughputs; "" for one run."""
    if len(result.get("runs", ())) < 2 or result.get("spread") is None:
        return ""
    return f"{result['spread']:.0%}"


def _with_spread(text: str, result: dict[str, Any]) -> str:
    spread = _spread(result)
    return f"{text} (spread {spread})" if spread else text


def _rate(value: float) -> str:
    """A throughput with three significant digits and a k/M suffix: 2222, 11.8k, 2.49M."""
    if value >= 1e6:
        return f"{value / 1e6:.3g}M"
    return f"{value / 1e3:.3g}k" if value >= 1e4 else f"{value:.4g}"


def _knobs(chosen: dict[str, Any] | None) -> str:
    """The DataLoader's chosen worker count, as the README shows it: `` (2 workers)``."""
    workers = (chosen or {}).get("num_workers")
    if workers is None:
        return ""
    return " (no workers)" if workers == 0 else f" ({workers} worker{'s' if workers > 1 else ''})"


def summary_table(report: dict[str, Any]) -> str:
    """The README's table: one row per workload, torch's best DataLoader (its throughput and
    workers), the zero-knob configurations and the best Python peer as ratios to it, the noise
    floor (the lowest twin of ``dataloader_best`` over the highest: a ratio above it cannot be told
    from the best row), and the two zero-knob configurations' peak held memory as ratios to torch's
    DataLoader's with as many workers and their ``converge_s``."""
    lines = [
        "| workload | torch DataLoader, best | `torchpipe_auto` "
        '| `tp.DataLoader(num_workers="auto")` | best Python peer | floor '
        "| peak held vs DataLoader, same workers | converge_s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    chosen = report.get("machine", {}).get("run", {}).get("chosen", {})
    for name, entry in report["workloads"].items():
        results, unit = entry["results"], entry["unit"]
        base = results.get(BASELINE, {}).get("throughput")
        if not base:
            continue
        ratios = [
            _with_spread(f"{results[c]['throughput'] / base:.2f}x", results[c])
            if c in results
            else "-"
            for c in ZERO_KNOB
        ]
        peers = [p for p in PEER_BESTS if p in results]
        best = max(peers, key=lambda p: results[p]["throughput"], default=None)
        peer = "-"
        if best is not None:
            ratio = f"{results[best]['throughput'] / base:.2f}x ({PEER_NAMES.get(best, best)})"
            peer = _with_spread(ratio, results[best])
        knobs = _knobs(chosen.get(name, {}).get(BASELINE))
        checks = [entry.get("targets", {}).get(c, {}) for c in ZERO_KNOB]
        peak = " / ".join(_figure(c.get("peak_vs_same_workers"), "{:.2f}x") for c in checks)
        converge = " / ".join(_figure(c.get("converge_s"), "{:.1f} s") for c in checks)
        noise = (entry.get("floor") or {}).get("ratio")
        floor = "-" if noise is None else f"{noise:.2f}"
        cells = [
            name,
            _with_spread(f"{_rate(base)} {unit}{knobs}", results[BASELINE]),
            *ratios,
            peer,
            floor,
            peak,
            converge,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _figure(check: dict[str, Any] | None, form: str) -> str:
    """A check's ratio in ``form``, ``-`` where it was not measured."""
    return "-" if not check or check.get("ratio") is None else form.format(check["ratio"])


def _cell(check: dict[str, Any] | None) -> str:
    if check is None:
        return ""
    if check["ratio"] is None:
        return "-"
    if check["op"] is None:
        return f"{check['ratio']:.2f}"
    against = f" ({check['against']})" if check.get("against") else ""
    if check.get("epoch") is not None:
        against = f" (epoch {check['epoch']})"  # the worst epoch, where every epoch is held to it
    floor = f", floor {check['floor']:.2f}" if check.get("floor") is not None else ""
    return f"{check['ratio']:.2f} {'ok' if check['met'] else '**miss**'}{against}{floor}"


def targets_table(report: dict[str, Any]) -> str:
    """One row per workload and zero-knob configuration: each target's ratio, whether it is met,
    which configuration the best of any loader and the best Python peer were, and where the
    zero-knob row ran and what its policy measured."""
    shown = reported(report)
    headings = [t.heading().replace(",", ", ") for t in shown]
    header = "| workload | configuration | " + " | ".join(headings) + " | where it ran |"
    lines = [header, "|---" * (3 + len(shown)) + "|"]
    for name, entry in report["workloads"].items():
        for config, checks in entry.get("targets", {}).items():
            if all(check["ratio"] is None for check in checks.values()):
                continue  # not measured on this workload (cache has no torchpipe_auto)
            cells = [_cell(checks.get(t.key)) for t in shown]
            found = entry.get("placement", {}).get(config)
            cells.append(describe(found).replace("|", "/") if found else "")
            lines.append(f"| {name} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench/run.py --json output")
    parser.add_argument(
        "--table",
        choices=(*TABLES, "all"),
        default="all",
        help="summary: README.md's; results, targets: bench/RESULTS.md's",
    )
    args = parser.parse_args(argv)
    with open(args.json) as f:
        report = json.load(f)
    makers = {"summary": summary_table, "results": results_table, "targets": targets_table}
    tables = TABLES if args.table == "all" else (args.table,)
    print("\n\n".join(makers[t](report) for t in tables))


if __name__ == "__main__":
    main()

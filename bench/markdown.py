"""The README's tables from a ``bench/run.py`` JSON: every configuration's row, and the targets.

Run: python bench/markdown.py docs/img/bench_quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.run import ORDER
from bench.targets import TARGETS

BASELINE = "dataloader_best"


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def results_table(report: dict[str, Any]) -> str:
    """One row per workload and configuration, in ``bench/run.py``'s order."""
    lines = ["| workload | configuration | throughput | vs dataloader_best | vs limit | first batch | peak RSS "
             "| end PSS | CPU per item | others |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in report["workloads"].items():
        results, limit, unit = entry["results"], entry["limit"], entry["unit"]
        base = results.get(BASELINE, {}).get("throughput")
        for config in sorted(results, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
            r = results[config]
            share = r.get("others_cpu_share")
            cells = [name, config, f"{r['throughput']:.4g} {unit}", f"{r['throughput'] / base:.2f}x" if base else "-",
                     f"{r['throughput'] / limit:.2f}" if limit else "-", f"{r['first_batch_s']:.2f} s",
                     _megabytes(r["peak_rss_mb"]), _megabytes(r.get("end_pss_mb")),
                     f"{r['cpu_s_per_item'] * 1e3:.3f} ms", "-" if share is None else f"{share:.0%}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(check: dict[str, Any] | None) -> str:
    if check is None:
        return ""
    if check["ratio"] is None:
        return "-"
    if check["op"] is None:
        return f"{check['ratio']:.2f}"
    against = f" ({check['against']})" if check.get("against") else ""
    return f"{check['ratio']:.2f} {'ok' if check['met'] else '**miss**'}{against}"


def targets_table(report: dict[str, Any]) -> str:
    """One row per workload and zero-knob configuration: each target's ratio, whether it is met,
    and which peer the best Python peer was."""
    headings = [t.heading().replace(",", ", ") for t in TARGETS]
    lines = ["| workload | configuration | " + " | ".join(headings) + " |", "|---" * (2 + len(TARGETS)) + "|"]
    for name, entry in report["workloads"].items():
        for config, checks in entry.get("targets", {}).items():
            if all(check["ratio"] is None for check in checks.values()):
                continue  # not measured on this workload (cache has no torchpipe_auto)
            cells = [_cell(checks.get(t.key)) for t in TARGETS]
            lines.append(f"| {name} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench/run.py --json output")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        report = json.load(f)
    print(results_table(report))
    print()
    print(targets_table(report))


if __name__ == "__main__":
    main()

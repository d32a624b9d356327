"""What ``bench/run.py`` prints and writes: the table of every row, the machine, the JSON.

``ORDER`` is the order rows are listed in (``bench/markdown.py`` and ``bench/plot.py`` use it too).
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import numpy as np
import torch

import torchpipe as tp
from torchpipe.runtime.cpu import usable_cpu_count

ORDER = (
    "dataloader_default",
    "dataloader_best",
    "torchpipe_dataloader",
    "torchpipe_dataloader_auto",
    "torchpipe_auto",
    "torchpipe_best",
    "torchpipe_tpimage",
    "torchpipe_cache_epoch1",
    "torchpipe_cache_epoch2",
    "nodes_best",
    "spdl_best",
    "grain_best",
    "ffcv_best",
    "tfdata_autotune",
    "tfdata_best",
    "tfdata_native",
    "tfdata_native_cache_epoch1",
    "tfdata_native_cache_epoch2",
)


def machine(quick: bool, grid: list[dict[str, int]]) -> dict[str, Any]:
    """What the numbers were measured on (``grid``: the DataLoader grid of the run)."""
    import PIL
    import psutil

    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), ""
    )
    return {
        "cpu": model or platform.processor(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "torchpipe": tp.__version__,
        "cuda": torch.cuda.is_available(),
        "run": {"quick": quick, "dataloader_grid": grid},
    }


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _epochs(result: dict[str, Any]) -> str:
    """A result's rate in each epoch, and where torchpipe ran it: ``epochs 79k (process x2), 229k``."""
    cells = []
    for rate, executor in zip(result["epoch_rates"], result["epoch_executors"]):
        cells.append(f"{rate / 1e3:.0f}k" + (f" ({executor})" if executor else ""))
    return "epochs " + ", ".join(cells)


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}MB"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _spread(result: dict[str, Any]) -> str:
    """``(max - min) / median`` of a result's throughputs, where it has more than one run."""
    return _share(result.get("spread")) if len(result.get("runs", ())) > 1 else "-"


def table(report: dict[str, Any]) -> str:
    """The printed summary: throughput, ratios against dataloader_best and the limit, and costs;
    every number is the median of the configuration's runs, and ``spread`` is ``(max - min) /
    median`` of their throughputs (``-`` for one run). ``floor`` is the workload's noise floor
    (``bench/targets.py``'s :func:`~bench.targets.floor`: below it, and only below it, a row misses
    ``vs DL best``); ``peak held`` what the tree held at its peak (sampled every 50 ms), ``end
    PSS`` its PSS at the end (for reference); ``converge`` the seconds from ``iter()`` to the
    first 0.5 s at the row's steady rate (``>`` where it never got there). ``others`` is the
    share of the cores other processes took during the measurement. A row whose data ended
    inside its window is marked ``(ended early)``. On an epochs workload (``blobs``) the
    throughput is the whole run's rate, each epoch's rate follows on a line of its own; a
    configuration that was not measured, or failed, says so."""
    lines = []
    header = (
        f"{'workload':<10} {'config':<25} {'throughput':>11} {'unit':<9} {'spread':>6} {'vs DL best':>10} "
        f"{'floor':>6} {'vs limit':>8} {'1st batch':>9} {'converge':>8} {'peak held':>9} {'end PSS':>8} "
        f"{'CPU/item':>10} {'others':>6}"
    )
    lines += [header, "-" * len(header)]
    for name, entry in report["workloads"].items():
        lines += _rows(name, entry)
    return "\n".join(lines)


def _rows(name: str, entry: dict[str, Any]) -> list[str]:
    """One workload's lines of :func:`table`."""
    results, limit, lines = entry["results"], entry["limit"], []
    base = results.get("dataloader_best", {}).get("throughput")
    floor = (entry.get("floor") or {}).get("ratio")
    for config in sorted(results, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
        r = results[config]
        vs_best = f"{r['throughput'] / base:.2f}x" if base else "-"
        vs_limit = f"{r['throughput'] / limit:.2f}" if limit else "-"
        lines.append(
            f"{name:<10} {config:<25} {r['throughput']:>11.4g} {entry['unit']:<9} {_spread(r):>6} {vs_best:>10} "
            f"{_ratio(floor):>6} {vs_limit:>8} {r['first_batch_s']:>8.2f}s {_converge(r):>8} "
            f"{_megabytes(r.get('peak_held_mb')):>9} {_megabytes(r.get('end_pss_mb')):>8} "
            f"{r['cpu_s_per_item'] * 1e3:>8.3f}ms {_share(r.get('others_cpu_share')):>6}"
            + (" (ended early)" if r.get("ended_early") else "")
        )
        if "epoch_rates" in r:
            lines.append(f"{'':<10} {'':<25} {_epochs(r)}")
    for library, why in entry.get("not_measured", {}).items():
        lines.append(f"{name:<10} {library:<25} {'not measured':>11} ({why})")
    for config, why in entry.get("failed", {}).items():
        lines.append(f"{name:<10} {config:<25} {'failed':>11} ({why[0].splitlines()[0]})")
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _converge(result: dict[str, Any]) -> str:
    """``1.25s``; ``>7.0s`` where the row never reached its steady rate; ``-`` where not measured."""
    value = result.get("converge_s")
    if value is None:
        return "-"
    return f"{value:.2f}s" if result.get("converged", True) else f">{value:.1f}s"


def write_report(report: dict[str, Any], path: str | None) -> None:
    """Write ``report`` as JSON to ``path`` and say so (nothing where ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")

"""The ``cow`` benchmark: a dataset whose Python index the workers copy (issue #41, decision 4).

A map-style dataset holds 1.5M path strings and 1.5M small label dicts (the ``--quick`` run:
500k of each), as a new user writes one; ``num_workers`` workers run ``epochs`` shuffled epochs
with ``persistent_workers=True``. Each read of ``self.paths[i]`` in a worker writes the item's
reference count, so over an epoch every worker ends up with a private copy of the pages it
touched: torch issue 13246, "DataLoader leaks memory". What a user sees is the growth of the
process tree's PSS from before the loader was made to the end of the last epoch (workers still
alive), and the samples a second.

Rows (each measured ``--repeat`` times, alternating, reported as medians):

- ``dataloader``: torch's DataLoader over the list-holding dataset;
- ``torchpipe_dataloader``: ``tp.DataLoader`` with the same arguments;
- ``torchpipe_dataloader_auto``: ``tp.DataLoader(num_workers="auto")``;
- ``dataloader_shared`` / ``torchpipe_dataloader_shared``: the same loaders over the dataset
  holding its index as one ``tp.SharedSequence`` (docs/dataloader.md).

Run: ``python -m bench.cow [--quick] [--repeat 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

import torchpipe as tp
from bench.measure import TreeMonitor, release_memory

ITEMS, QUICK_ITEMS = 1_500_000, 500_000
WORKERS, EPOCHS, BATCH = 4, 2, 256
TARGETS = {"torchpipe_dataloader": 1.0, "torchpipe_dataloader_shared": 0.2}
"""Growth at most this share of torch's DataLoader's (the shared index: at >= 0.95x its speed)."""
SHARED_SPEED = 0.95


class Index(torch.utils.data.Dataset):
    """Samples as a new user keeps them: a list of paths and a list of label dicts."""

    def __init__(self, items: int) -> None:
        self.paths = [f"/data/train/class_{i % 1000:04d}/image_{i:08d}.JPEG" for i in range(items)]
        self.labels = [{"class": i % 1000, "split": "train", "weight": 1.0} for i in range(items)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return _sample(self.paths[i], self.labels[i])


class SharedIndex(torch.utils.data.Dataset):
    """The same samples, held as one ``tp.SharedSequence`` of ``(path, label)`` pairs."""

    def __init__(self, items: int) -> None:
        index = Index(items)
        self.samples = tp.SharedSequence(zip(index.paths, index.labels))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        return _sample(path, label)


def _sample(path: str, label: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """A cheap stand-in for loading the file: a small tensor derived from its path."""
    return torch.full((8,), float(zlib.crc32(path.encode()) & 0xFFFF)), int(label["class"])


def configurations() -> dict[str, tuple[Callable[..., Any], str, Any]]:
    """Row name -> (loader class, dataset kind, num_workers)."""
    loader = torch.utils.data.DataLoader
    return {
        "dataloader": (loader, "list", WORKERS),
        "torchpipe_dataloader": (tp.DataLoader, "list", WORKERS),
        "torchpipe_dataloader_auto": (tp.DataLoader, "list", "auto"),
        "dataloader_shared": (loader, "shared", WORKERS),
        "torchpipe_dataloader_shared": (tp.DataLoader, "shared", WORKERS),
    }


def measure_one(
    make_loader: Callable[..., Any], dataset: Any, num_workers: Any, epochs: int
) -> dict[str, Any]:
    """PSS growth of the process tree from before the loader is made to the end of its last
    epoch (workers alive), and samples a second over the epochs."""
    release_memory()
    monitor = TreeMonitor()
    before = monitor.pss()
    loader = make_loader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=num_workers,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    started, samples = time.perf_counter(), 0
    for _ in range(epochs):
        for _, labels in loader:
            samples += len(labels)
    elapsed = time.perf_counter() - started
    after = monitor.pss()
    workers = loader.stats()[0]["workers"] if isinstance(loader, tp.DataLoader) else num_workers
    del loader
    release_memory()
    growth = (after - before) / 2**20 if before is not None and after is not None else None
    return {"growth_mb": growth, "samples_per_s": samples / elapsed, "workers": workers}


def run(
    items: int, repeat: int, epochs: int = EPOCHS, names: list[str] | None = None
) -> dict[str, Any]:
    """Every row ``repeat`` times, alternating; medians and the targets' verdicts."""
    datasets = {"list": Index(items), "shared": SharedIndex(items)}
    rows = {k: v for k, v in configurations().items() if names is None or k in names}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    for lap in range(repeat):
        for name, (make, kind, workers) in rows.items():
            result = measure_one(make, datasets[kind], workers, epochs)
            runs[name].append(result)
            print(
                f"  [{lap + 1}/{repeat}] {name}: +{result['growth_mb']:.0f} MB, "
                f"{result['samples_per_s']:.4g} samples/s",
                flush=True,
            )
    results = {name: _median(r) for name, r in runs.items()}
    return {
        "items": items,
        "epochs": epochs,
        "repeat": repeat,
        "results": results,
        "runs": runs,
        "targets": verdicts(results),
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "growth_mb": statistics.median(r["growth_mb"] for r in runs),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
        "workers": runs[-1]["workers"],
    }


def verdicts(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target's ratio to torch's DataLoader's growth (and speed, for the shared index)."""
    torch_row = results.get("dataloader")
    out: dict[str, dict[str, Any]] = {}
    if torch_row is None or torch_row["growth_mb"] <= 0:
        return out
    for name, most in TARGETS.items():
        row = results.get(name)
        if row is None:
            continue
        ratio = row["growth_mb"] / torch_row["growth_mb"]
        speed = row["samples_per_s"] / torch_row["samples_per_s"]
        met = ratio <= most and (speed >= SHARED_SPEED if name.endswith("shared") else True)
        out[name] = {
            "growth_vs_torch": round(ratio, 3),
            "speed_vs_torch": round(speed, 3),
            "target": most,
            "met": met,
        }
    return out


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table (growth, speed, and their ratios to torch's)."""
    results, base = report["results"], report["results"].get("dataloader")
    lines = [
        "| configuration | workers | PSS growth | samples/s | growth vs torch | speed vs torch |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        growth = (
            f"{row['growth_mb'] / base['growth_mb']:.2f}x"
            if base and base["growth_mb"] > 0
            else "-"
        )
        speed = f"{row['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {row['workers']} | +{row['growth_mb']:.0f} MB | {row['samples_per_s']:.4g} | "
            f"{growth} | {speed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ITEMS} items instead of {ITEMS}"
    )
    parser.add_argument(
        "--items", type=int, default=None, help="items in the index (overrides --quick)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="measure each row this many times, alternating"
    )
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.epochs < 1:
        parser.error("--repeat and --epochs must be >= 1")
    items = args.items or (QUICK_ITEMS if args.quick else ITEMS)
    report = run(items, args.repeat, args.epochs)
    print(table(report))
    for name, verdict in report["targets"].items():
        print(
            f"  {name}: growth {verdict['growth_vs_torch']}x torch's (target <= {verdict['target']}x), "
            f"speed {verdict['speed_vs_torch']}x: {'met' if verdict['met'] else 'MISSED'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""The soak: many epochs on one loader with ``persistent_workers=True`` (issue #41).

The ``jpeg`` workload's dataset (Pillow decode, random 224 crop, flip; batch 64) runs ``epochs``
epochs on one loader; the process tree's PSS is read after each. What must hold: PSS after the
last epoch within 5% of PSS after epoch 2 (the first epoch sizes the rings and warms the heaps,
the second is the steady state), for ``tp.DataLoader`` with ``num_workers`` workers and with
``"auto"``, beside torch's DataLoader as the reference.

Run: ``python -m bench.soak [--epochs 20] [--workers 2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

import torchpipe as tp
from bench import workloads as wl
from bench.measure import TreeMonitor, release_memory

EPOCHS, WORKERS = 20, 2
GROWTH = 0.05
"""The most PSS may grow from the end of epoch 2 to the end of the last."""


def pss_by_epoch(
    make: Callable[..., Any], dataset: Any, num_workers: Any, epochs: int
) -> list[float]:
    """The tree's PSS in MB after each of ``epochs`` epochs of one persistent loader."""
    release_memory()
    monitor = TreeMonitor()
    loader = make(dataset, batch_size=64, num_workers=num_workers, persistent_workers=True)
    after = []
    for _ in range(epochs):
        for batch in loader:
            del batch
        pss = monitor.pss()
        after.append(pss / 2**20 if pss is not None else float("nan"))
    del loader
    release_memory()
    return after


def run(files: int, epochs: int, workers: int) -> dict[str, Any]:
    """Each loader's PSS by epoch and whether the last is within :data:`GROWTH` of epoch 2's."""
    dataset = wl.Mapped(wl.JpegSample(wl.data.jpeg_files(files)), files)
    loaders = {
        "dataloader": (torch.utils.data.DataLoader, workers),
        "torchpipe_dataloader": (tp.DataLoader, workers),
        "torchpipe_dataloader_auto": (tp.DataLoader, "auto"),
    }
    report: dict[str, Any] = {"files": files, "epochs": epochs, "workers": workers, "loaders": {}}
    for name, (make, num_workers) in loaders.items():
        pss = pss_by_epoch(make, dataset, num_workers, epochs)
        growth = pss[-1] / pss[1] - 1 if epochs > 1 else 0.0
        report["loaders"][name] = {
            "pss_mb": [round(p, 1) for p in pss],
            "growth_after_epoch_2": round(growth, 4),
            "met": growth <= GROWTH,
        }
        print(
            f"  {name}: epoch 2 {pss[min(1, epochs - 1)]:.0f} MB, epoch {epochs} {pss[-1]:.0f} MB "
            f"({growth:+.1%}): {'met' if growth <= GROWTH else 'MISSED'}",
            flush=True,
        )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument(
        "--files", type=int, default=wl.QUICK.jpeg_files, help="JPEG files in an epoch"
    )
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.workers < 1 or args.files < 1:
        parser.error("--epochs must be >= 2, --workers and --files >= 1")
    report = run(args.files, args.epochs, args.workers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""The benchmark suite: torchpipe against torch's DataLoader and the peers, side by side.

Every configuration of a workload runs the same per-item work with the same batch size, one
after another in this one process, so their ratios are comparable (absolute numbers from
different runs are not: machines are noisy). Synthetic data is generated once into
``$TORCHPIPE_BENCH_CACHE`` (default ``~/.cache/torchpipe-bench``); nothing is downloaded.

Configurations:
  dataloader_default         torch DataLoader, num_workers=0
  dataloader_best            torch DataLoader, the best of a grid of num_workers and prefetch_factor
  torchpipe_dataloader       torchpipe.DataLoader with dataloader_best's arguments
  torchpipe_dataloader_auto  torchpipe.DataLoader(num_workers="auto"), no other knob
  torchpipe_auto             the DSL with tp.AUTOTUNE everywhere (no knobs)
  torchpipe_best             the DSL, the best of a small grid of num_parallel_calls and executor
  torchpipe_tpimage          (jpeg, tfrecord) the same work in tp.image's ops, tp.AUTOTUNE everywhere
  torchpipe_cache_epoch1/2   (workload cache) the jpeg pipeline with cache() after decode
  nodes_best                 torchdata.nodes: the best of ParallelMapper on threads or processes
  spdl_best                  SPDL: the best of PipelineBuilder's pipe on threads or processes
  grain_best                 Grain: the best of to_iter_dataset's threads or mp_prefetch's processes
  ffcv_best                  (jpeg) FFCV's own loader and ops over a .beton: the best of its thread counts
  tfdata_autotune            tf.data over the same Python item (tf.py_function), AUTOTUNE
  tfdata_best                the same, the best of AUTOTUNE and a grid of num_parallel_calls
  tfdata_native              (jpeg, bigtensor, tiny, tfrecord) tf.data with TensorFlow's own ops
  tfdata_native_cache_epoch1/2  (workload cache) those ops with tf.data's cache() after decode

The peers (``bench/peers.py``, ``bench/tfdata.py``) run the workload's own item function and
collation; one that is not installed is reported "not installed". On ``blobs`` they are not
measured (their adapters make one pass; none keeps workers across epochs): the report says so.
tf.data runs after every
other configuration of every workload (TensorFlow's threads must not be inherited by worker
processes forked later).

After the table, the two zero-knob configurations (torchpipe_dataloader_auto, torchpipe_auto)
are checked against their targets (``bench/targets.py``), the best Python peer's best among
them; the JSON has the same checks under ``workloads.<name>.targets``.

Run: python bench/run.py [--quick] [--workloads jpeg,bigtensor,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench import peers as pr
from bench import suite, tpimage
from bench import workloads as wl
from bench.measure import measure, measure_epochs
from bench.targets import BUDGET_CONFIG, format_targets, targets
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
LAST = ("tfdata",)
BUDGETED = ("jpeg", "bigtensor", "tfrecord")
"""Workloads with large batches, where ``tp.DataLoader("auto")`` is also measured under a RAM budget."""
"""Peers measured after every workload's other configurations (they import TensorFlow)."""
NOT_MEASURED_EPOCHS = "its adapter makes one pass over the items; persistent workers across epochs not adapted"
"""Why the peers have no row on an epochs workload (``blobs``)."""


def dataloader_grid(quick: bool) -> list[dict[str, int]]:
    """DataLoader arguments tried for ``dataloader_best`` (num_workers=0 is ``dataloader_default``)."""
    cores = usable_cpu_count()
    # On small machines the quick grid is the full one; on big ones it skips most worker counts.
    workers = list(range(1, 2 * cores + 1))
    if quick and cores > 2:
        workers = sorted({1, cores // 2, cores, 2 * cores})
    return [{"num_workers": n, "prefetch_factor": f} for n in workers for f in (2, 4)]


class Runner:
    """Measures the configurations of one workload and remembers what was chosen."""

    def __init__(self, work: wl.Workload, sizes: wl.Sizes, quick: bool) -> None:
        self.work, self.sizes, self.quick = work, sizes, quick
        self.results: dict[str, dict[str, float]] = {}
        self.chosen: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.not_measured: dict[str, str] = {}
        self.dataloader_pss: dict[int, float | None] = {}  # torch's end PSS by num_workers, prefetch_factor=2
        self.grid: list[tuple[dict[str, int], dict[str, Any]]] = []  # every DataLoader configuration measured
        self.budget: dict[str, Any] | None = None  # the RAM budget's check (BUDGETED workloads)
        # cache measures whole epochs; every other workload a timed window
        self.measure_one = self.epoch if work.name == "cache" else self.timed

    def epochs(self, make: Callable[[], Any]) -> dict[str, Any]:
        """``work.epochs`` whole epochs of one loader (the ``blobs`` workload's measure)."""
        return measure_epochs(make, self.work.count, self.work.epochs)

    def timed(self, make: Callable[[], Any]) -> dict[str, float]:
        return measure(make, self.work.count, self.sizes.warmup_s, self.sizes.seconds)

    def epoch(self, make: Callable[[], Any]) -> dict[str, float]:
        """One whole epoch, from ``iter()`` to its end (the ``cache`` workload's measure)."""
        return measure(make, self.work.count, 0.0, math.inf, whole_epoch=True)

    def record(self, config: str, result: dict[str, Any], note: str = "") -> None:
        self.results[config] = result
        unit = self.work.unit
        print(f"  {config:<24} {result['throughput']:>12.4g} {unit:<9} {note}", flush=True)
        if "epoch_rates" in result:
            print(f"    {_epochs(result)}", flush=True)

    def dataloaders(self, measure_one: Callable[[Callable[[], Any]], dict[str, float]]) -> dict[str, Any]:
        """``dataloader_default`` and ``dataloader_best``; returns the best arguments."""
        dataset, loader_kwargs = self.work.dataset, self.work.loader_kwargs
        default = measure_one(lambda: torch.utils.data.DataLoader(dataset, num_workers=0, **loader_kwargs(0)))
        self.record("dataloader_default", default, "num_workers=0")
        self.dataloader_pss[0] = default.get("end_pss_mb")
        best_args, best = {"num_workers": 0}, default
        self.grid.append((best_args, default))
        for args in dataloader_grid(self.quick):
            kwargs = loader_kwargs(args["num_workers"])
            result = measure_one(lambda: torch.utils.data.DataLoader(dataset, **args, **kwargs))
            print(f"    grid {args}: {result['throughput']:.4g}", flush=True)
            self.grid.append((args, result))
            if args.get("prefetch_factor") == 2:  # the memory target's reference at each worker count
                self.dataloader_pss[args["num_workers"]] = result.get("end_pss_mb")
            if "epoch_rates" in result:
                print(f"      {_epochs(result)}", flush=True)
            if result["throughput"] > best["throughput"]:
                best_args, best = args, result
        self.record("dataloader_best", best, str(best_args))
        self.chosen["dataloader_best"] = best_args
        return best_args

    def torchpipe_dsl(self) -> None:
        """``torchpipe_auto`` (no knobs) and ``torchpipe_best`` (a grid of explicit knobs)."""
        work = self.work
        auto = self.timed(lambda: work.batched(tp.AUTOTUNE, "auto").prefetch(tp.AUTOTUNE))
        self.record("torchpipe_auto", auto, "num_parallel_calls=AUTOTUNE, executor='auto', prefetch(AUTOTUNE)")
        best_knobs, best = None, None
        for parallel, executor in work.tp_grid:
            result = self.timed(lambda: work.batched(parallel, executor).prefetch(tp.AUTOTUNE))
            knobs = {"num_parallel_calls": parallel, "executor": executor}
            print(f"    grid {knobs}: {result['throughput']:.4g}", flush=True)
            if best is None or result["throughput"] > best["throughput"]:
                best_knobs, best = knobs, result
        self.record("torchpipe_best", best, str(best_knobs))
        self.chosen["torchpipe_best"] = best_knobs

    def torchpipe_dataloader_auto(self, measure_one: Callable[[Callable[[], Any]], dict[str, float]]) -> None:
        """``torchpipe_dataloader_auto``: the drop-in DataLoader with no knob but ``num_workers="auto"``."""
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs("auto")
        result = measure_one(lambda: tp.DataLoader(dataset, num_workers="auto", **kwargs))
        self.record("torchpipe_dataloader_auto", result, "num_workers='auto'")

    def run(self) -> None:
        """Every configuration of a throughput workload."""
        best_args = self.dataloaders(self.timed)
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs(best_args["num_workers"])
        self.record("torchpipe_dataloader", self.timed(lambda: tp.DataLoader(dataset, **best_args, **kwargs)),
                    str(best_args))  # fmt: skip
        self.torchpipe_dataloader_auto(self.timed)
        if self.work.name in BUDGETED:
            self.torchpipe_dataloader_budget()
        self.torchpipe_dsl()
        self.torchpipe_tpimage()
        self.peers(last=False)

    def torchpipe_tpimage(self) -> None:
        """``torchpipe_tpimage``: the workload's work in ``tp.image``'s ops, zero knobs, where it has
        such a pipeline (``bench/tpimage.py``)."""
        if self.work.name not in tpimage.PIPELINES:
            return
        result = self.timed(lambda: tpimage.batched(self.work))
        self.record(tpimage.CONFIG, result, "tp.image ops, num_parallel_calls=AUTOTUNE, prefetch(AUTOTUNE)")

    def torchpipe_dataloader_budget(self) -> None:
        """``tp.DataLoader("auto")`` under a RAM budget that binds: halfway between the tree's end
        PSS without workers (``dataloader_default``) and ``torchpipe_dataloader_auto``'s, so its
        unconstrained choice does not fit and some parallelism may; held to the fastest
        DataLoader configuration that ends within it."""
        base = self.dataloader_pss.get(0)
        unconstrained = self.results.get("torchpipe_dataloader_auto", {}).get("end_pss_mb")
        if base is None or unconstrained is None or unconstrained <= base:
            return
        total = (base + unconstrained) / 2
        fitting = [(a, r) for a, r in self.grid if r.get("end_pss_mb") is not None and r["end_pss_mb"] <= total]
        best_args, best = max(fitting, key=lambda pair: pair[1]["throughput"], default=({}, {"throughput": None}))
        options = tp.AutotuneOptions(ram_budget=(total - base) * 2**20)
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs("auto")
        result = self.timed(lambda: tp.DataLoader(dataset, num_workers="auto", autotune=options, **kwargs))
        self.record(BUDGET_CONFIG, result, f"ram_budget={total - base:.0f} MB: the tree at {total:.0f} MB, "
                                           f"halfway from {base:.0f} MB without workers")  # fmt: skip
        self.budget = {"pss_mb": total, "ram_budget_mb": total - base, "best_args": best_args,
                       "best_throughput": best["throughput"]}  # fmt: skip

    def run_cache(self) -> None:
        """The ``cache`` workload: DataLoader baselines and torchpipe's epochs 1 and 2, each a full epoch.

        ``torchpipe_dataloader_auto`` runs the same uncached epoch as the DataLoader baselines.
        """
        self.dataloaders(self.epoch)
        self.torchpipe_dataloader_auto(self.epoch)
        cores = usable_cpu_count()
        pipeline = self.work.batched(cores, "thread").prefetch(tp.AUTOTUNE)  # one Dataset: its cache persists
        knobs = f"decode num_parallel_calls={cores}, executor='thread'"
        self.record("torchpipe_cache_epoch1", self.epoch(lambda: pipeline), knobs)
        self.record("torchpipe_cache_epoch2", self.epoch(lambda: pipeline), "replays the decoded images")
        self.chosen["torchpipe_cache"] = {"num_parallel_calls": cores, "executor": "thread"}
        self.peers(last=False)

    def run_epochs(self) -> None:
        """An epochs workload (``blobs``): each configuration is one loader run for ``work.epochs``
        whole epochs, workers persistent; torchpipe's zero-knob configurations and the DataLoader
        with ``dataloader_best``'s arguments."""
        best_args = self.dataloaders(self.epochs)
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs(best_args["num_workers"])
        self.record("torchpipe_dataloader", self.epochs(lambda: tp.DataLoader(dataset, **best_args, **kwargs)),
                    str(best_args))  # fmt: skip
        self.torchpipe_dataloader_auto(self.epochs)
        pipeline = self.work.batched(tp.AUTOTUNE, "auto").prefetch(tp.AUTOTUNE)  # one Dataset, iterated per epoch
        self.record("torchpipe_auto", self.epochs(lambda: pipeline), "num_parallel_calls=AUTOTUNE, executor='auto'")
        self.peers(last=False)

    def peers(self, last: bool) -> None:
        """The installed peers (those in ``LAST`` when ``last``, the others when not)."""
        for peer in pr.PEERS:
            if not peer.installed() or (peer.library in LAST) != last:
                continue
            if peer.workloads is not None and self.work.name not in peer.workloads:
                continue
            if self.work.epochs:
                self.not_measured[peer.library] = NOT_MEASURED_EPOCHS
                print(f"  {peer.library + '_best':<24} not measured: {NOT_MEASURED_EPOCHS}", flush=True)
            else:
                self.peer(peer)

    def peer(self, peer: pr.Peer) -> None:
        """One library: its named configurations, and the best of its grid as ``<library>_best``.

        A library that fails on this workload is reported (printed, and in the JSON under
        ``workloads.<name>.peer_errors``) and the run goes on with the next one.
        """
        best_knobs, best = None, None
        try:
            for config in peer.configs(self.work, self.quick):
                result = self.measure_one(config.make)
                if config.name is not None:
                    self.record(config.name, result, str(config.knobs))
                else:
                    print(f"    {peer.library} grid {config.knobs}: {result['throughput']:.4g}", flush=True)
                if config.in_best and (best is None or result["throughput"] > best["throughput"]):
                    best_knobs, best = config.knobs, result
        except Exception as e:  # noqa: BLE001 - one peer's failure must not hide the others' numbers
            self.errors[peer.library] = f"{type(e).__name__}: {e}"
            print(f"  {peer.library} failed on {self.work.name}: {self.errors[peer.library]}", flush=True)
            return
        if best is not None:
            self.record(f"{peer.library}_best", best, str(best_knobs))
            self.chosen[f"{peer.library}_best"] = best_knobs


def machine(quick: bool) -> dict[str, Any]:
    """What the numbers were measured on."""
    import PIL
    import psutil

    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "")
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
        "run": {"quick": quick, "dataloader_grid": dataloader_grid(quick)},
    }


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def run_all(names: list[str], quick: bool, sizes: wl.Sizes | None = None) -> dict[str, Any]:
    """Measure ``names`` and return the report (the JSON document)."""
    sizes = sizes or (wl.QUICK if quick else wl.FULL)
    report: dict[str, Any] = {"machine": machine(quick), "workloads": {}}
    run_info = report["machine"]["run"]
    run_info.update(chosen={}, limit_notes={}, peers=pr.notes())
    for library, note in run_info["peers"].items():
        print(f"{library}: {note}", flush=True)
    runners = []
    for name in names:
        work = suite.WORKLOADS[name](sizes, quick)
        limit = "null" if work.limit is None else f"{work.limit:.4g} {work.unit}"
        extra = "".join(f", {key} {value}" for key, value in work.extra.items())
        print(f"\n{name}: batch {work.batch_size}, limit {limit} ({work.limit_note}){extra}", flush=True)
        runner = Runner(work, sizes, quick)
        if name == "cache":
            runner.run_cache()
        elif work.epochs:
            runner.run_epochs()
        else:
            runner.run()
        runners.append(runner)
    for runner in runners:
        if any(peer.installed() and peer.library in LAST for peer in pr.PEERS):
            print(f"\n{runner.work.name}, measured last: {', '.join(LAST)}", flush=True)
            runner.peers(last=True)
    for runner in runners:
        work = runner.work
        report["workloads"][work.name] = {"unit": work.unit, "limit": work.limit, "results": runner.results,
                                          "targets": targets(work.name, runner.results, runner.dataloader_pss,
                                                             runner.budget),
                                          "budget": runner.budget,
                                          "dataloader_pss": {str(k): v for k, v in runner.dataloader_pss.items()},
                                          "extra": work.extra, "peer_errors": runner.errors,
                                          "not_measured": runner.not_measured}  # fmt: skip
        run_info["chosen"][work.name] = runner.chosen
        run_info["limit_notes"][work.name] = work.limit_note
    return report


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


def table(report: dict[str, Any]) -> str:
    """The printed summary: throughput, ratios against dataloader_best and the limit, and costs;
    ``others`` is the share of the cores other processes took during the measurement. On an
    epochs workload (``blobs``) the throughput is the steady rate, each epoch's rate follows on a
    line of its own, and a peer that was not measured says so."""
    lines = []
    header = (f"{'workload':<10} {'config':<25} {'throughput':>11} {'unit':<9} {'vs DL best':>10} {'vs limit':>8} "
              f"{'1st batch':>9} {'peak RSS':>9} {'end PSS':>8} {'CPU/item':>10} {'others':>6}")  # fmt: skip
    lines += [header, "-" * len(header)]
    for name, entry in report["workloads"].items():
        results, limit = entry["results"], entry["limit"]
        base = results.get("dataloader_best", {}).get("throughput")
        for config in sorted(results, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
            r = results[config]
            vs_best = f"{r['throughput'] / base:.2f}x" if base else "-"
            vs_limit = f"{r['throughput'] / limit:.2f}" if limit else "-"
            lines.append(
                f"{name:<10} {config:<25} {r['throughput']:>11.4g} {entry['unit']:<9} {vs_best:>10} {vs_limit:>8} "
                f"{r['first_batch_s']:>8.2f}s {r['peak_rss_mb']:>7.0f}MB {_megabytes(r.get('end_pss_mb')):>8} "
                f"{r['cpu_s_per_item'] * 1e3:>8.3f}ms"
                f" {_share(r.get('others_cpu_share')):>6}"
            )
            if "epoch_rates" in r:
                lines.append(f"{'':<10} {'':<25} {_epochs(r)}")
        for library, why in entry.get("not_measured", {}).items():
            lines.append(f"{name:<10} {library + '_best':<25} {'not measured':>11} ({why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small data and small grids: about 8 minutes on 2 cores with every peer installed",
    )
    parser.add_argument(
        "--workloads", default=",".join(suite.WORKLOADS), help=f"comma-separated, from {list(suite.WORKLOADS)}"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in suite.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(suite.WORKLOADS)}")
    start = time.perf_counter()
    report = run_all(names, args.quick)
    report["machine"]["run"]["seconds"] = round(time.perf_counter() - start, 1)
    print()
    if args.quick:
        grid = sorted({g["num_workers"] for g in dataloader_grid(True)})
        print(f"--quick: smaller data, short measurements; DataLoader grid num_workers {grid} x prefetch_factor 2/4")
    for config, note in report["machine"]["run"]["peers"].items():
        print(f"{config}: {note}")
    print(table(report))
    print()
    print(format_targets(report))
    print(f"\n{report['machine']['run']['seconds']:.0f} s in all; usable cores: {usable_cpu_count()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

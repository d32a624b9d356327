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
collation; one that is not installed is reported "not installed". On ``blobs`` they run their
epochs on one loader as a user would, keeping workers across epochs where the library can
(``bench/peer_items.PeerEpochs``). tf.data runs after every other configuration of every
workload (TensorFlow's threads must not be inherited by worker processes forked later).

``--ring-ab`` measures every torchpipe row also under the ring policy before slot rings
(``TORCHPIPE_RING_POLICY=legacy``, a twin row ``<config>@legacy_rings`` beside it in each round)
and reports each row's throughput and end PSS as ratios to its twin (``workloads.<name>.ring_ab``;
issue #41's "speed held"). ``--no-peers`` leaves the peers out (a run about torchpipe alone).

``--repeat N`` measures every configuration N times, alternating configurations within the
run (A B C A B C ...: ``bench/rounds.py``); each row is then the median of its runs with their
spread, the JSON keeps every run's values (``results.<config>.runs``), and every ratio and
target verdict is computed from the medians (issue #42).

After the table, the two zero-knob configurations (torchpipe_dataloader_auto, torchpipe_auto)
are checked against their targets (``bench/targets.py``), and where each ran and what its
placement policy measured is printed beside them; the JSON has the same under
``workloads.<name>.targets`` and ``workloads.<name>.placement``.

Run: python bench/run.py [--quick] [--repeat 3] [--workloads jpeg,bigtensor,...] [--ring-ab] [--no-peers]
                        [--json out.json]
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
from functools import partial
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench import peers as pr
from bench import suite, tpimage
from bench import workloads as wl
from bench.measure import measure, measure_epochs
from bench.rounds import Trial, run_rounds, summarize
from bench.rounds import report as rounds_report
from bench.targets import BASELINE, BUDGET_CONFIG, format_targets, placements, targets
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.processes.output import LEGACY, RING_POLICY_ENV

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
"""Peers measured after every workload's other configurations (they import TensorFlow)."""
BUDGETED = ("jpeg", "bigtensor", "tfrecord")
"""Workloads with large batches, where ``tp.DataLoader("auto")`` is also measured under a RAM budget."""
LEGACY_RINGS = "@legacy_rings"
"""The suffix of a ``--ring-ab`` twin: the row measured under the ring policy before slot rings."""
NOT_MEASURED_EPOCHS = "its adapter runs no epochs (it makes one pass over other work)"
"""Why a peer's configuration has no row on an epochs workload (``blobs``)."""


def dataloader_grid(quick: bool) -> list[dict[str, int]]:
    """DataLoader arguments tried for ``dataloader_best`` (num_workers=0 is ``dataloader_default``)."""
    cores = usable_cpu_count()
    workers = list(range(1, 2 * cores + 1))
    if not quick:
        return [{"num_workers": n, "prefetch_factor": f} for n in workers for f in (2, 4)]
    # Quick: torch's default prefetch_factor at every worker count up to twice the cores (on big
    # machines 1, half the cores, the cores and twice), and 4 at one worker a core, where it
    # has won (QUICK's longer windows pay for the points left out: issue #42).
    if cores > 2:
        workers = sorted({1, cores // 2, cores, 2 * cores})
    return [{"num_workers": n, "prefetch_factor": 2} for n in workers] + [{"num_workers": cores, "prefetch_factor": 4}]


class Runner:
    """Measures the configurations of one workload in rounds and remembers what was chosen.

    A round (``bench/rounds.py``) measures every configuration that needs nothing from another
    once; ``repeat`` rounds alternate them (A B C A B C). Then the configurations that depend on
    those medians (``torchpipe_dataloader`` with ``dataloader_best``'s arguments, the budgeted
    loader) are measured in rounds of their own, and the peers in ``LAST`` after every workload.
    """

    def __init__(self, work: wl.Workload, sizes: wl.Sizes, quick: bool, repeat: int = 1, ring_ab: bool = False,
                 peers: bool = True) -> None:  # fmt: skip
        self.work, self.sizes, self.quick, self.repeat = work, sizes, quick, repeat
        self.ring_ab, self.peers = ring_ab, peers
        self.results: dict[str, dict[str, Any]] = {}
        self.chosen: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.not_measured: dict[str, str] = {}
        self.dataloader_pss: dict[int, float | None] = {}  # torch's end PSS by num_workers, prefetch_factor=2
        self.dataloader_held: dict[int, float | None] = {}  # and what it held, shared memory counted once
        self.grid: list[tuple[dict[str, int], dict[str, Any]]] = []  # every DataLoader configuration measured
        self.budget: dict[str, Any] | None = None  # the RAM budget's check (BUDGETED workloads)
        # cache measures whole epochs, blobs several on one loader, every other workload a timed window
        self.measure_one = self.epoch if work.name == "cache" else self.epochs if work.epochs else self.timed

    def epochs(self, make: Callable[[], Any]) -> dict[str, Any]:
        """``work.epochs`` whole epochs of one loader (the ``blobs`` workload's measure)."""
        return measure_epochs(make, self.work.count, self.work.epochs)

    def timed(self, make: Callable[[], Any]) -> dict[str, Any]:
        return measure(make, self.work.count, self.sizes.warmup_s, self.sizes.seconds)

    def epoch(self, make: Callable[[], Any]) -> dict[str, Any]:
        """One whole epoch, from ``iter()`` to its end (the ``cache`` workload's measure)."""
        return measure(make, self.work.count, 0.0, math.inf, whole_epoch=True)

    def trial(self, name: str, make: Callable[[], Any], knobs: Any, **kwargs: Any) -> Trial:
        """A configuration measured by this workload's measure (``kwargs``: :class:`Trial`'s)."""
        return Trial(name, partial(self.measure_one, make), name=name, knobs=knobs, **kwargs)

    def run(self) -> None:
        """Every configuration of the workload, but those measured last (``LAST``)."""
        self.measure_rounds(self.plan)
        self.grid_pss()
        self.measure_rounds(self.dependent)

    def plan(self) -> list[Trial]:
        """One round's configurations that need nothing from another's results, in order."""
        work, trials = self.work, self.dataloader_trials()
        dataset, kwargs = work.dataset, work.loader_kwargs("auto")
        auto_loader = partial(tp.DataLoader, dataset, num_workers="auto", **kwargs)
        trials.append(self.trial("torchpipe_dataloader_auto", auto_loader, "num_workers='auto'"))
        if work.name == "cache":
            trials += self.cache_trials()
        else:
            auto = "num_parallel_calls=AUTOTUNE, executor='auto', prefetch(AUTOTUNE)"
            trials.append(self.trial("torchpipe_auto", partial(dsl_pipeline, work, tp.AUTOTUNE, "auto"), auto))
        if not work.epochs and work.name != "cache":
            for parallel, executor in work.tp_grid:
                knobs = {"num_parallel_calls": parallel, "executor": executor}
                make = partial(dsl_pipeline, work, parallel, executor)
                trials.append(Trial(f"torchpipe {knobs}", partial(self.timed, make), best_of="torchpipe_best",
                                    knobs=knobs))  # fmt: skip
            if work.name in tpimage.PIPELINES:
                knobs = "tp.image ops, num_parallel_calls=AUTOTUNE, prefetch(AUTOTUNE)"
                trials.append(self.trial(tpimage.CONFIG, partial(tpimage.batched, work), knobs))
        return self.with_twins(trials) + self.peer_trials(last=False)

    def with_twins(self, trials: list[Trial]) -> list[Trial]:
        """``trials``, each torchpipe row followed by its ``--ring-ab`` twin (under the legacy ring
        policy) where this run measures them."""
        if not self.ring_ab:
            return trials
        out = []
        for trial in trials:
            out.append(trial)
            if trial.key.startswith("torchpipe"):
                name, best = trial.name and trial.name + LEGACY_RINGS, trial.best_of and trial.best_of + LEGACY_RINGS
                legacy = partial(_under_legacy_rings, trial.measure)
                out.append(Trial(trial.key + LEGACY_RINGS, legacy, name=name, best_of=best, knobs=trial.knobs))
        return out

    def dataloader_trials(self) -> list[Trial]:
        """``dataloader_default`` and the grid ``dataloader_best`` is the best of (default included)."""
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs
        default = self.trial("dataloader_default", partial(torch_loader, dataset, {"num_workers": 0}, kwargs(0)),
                             {"num_workers": 0}, best_of=BASELINE)  # fmt: skip
        grid = []
        for args in dataloader_grid(self.quick):
            make = partial(torch_loader, dataset, args, kwargs(args["num_workers"]))
            grid.append(Trial(f"dataloader {args}", partial(self.measure_one, make), best_of=BASELINE, knobs=args))
        return [default, *grid]

    def cache_trials(self) -> list[Trial]:
        """torchpipe's epochs 1 and 2 of one cached pipeline (made afresh each round)."""
        cores = usable_cpu_count()
        pipeline = self.work.batched(cores, "thread").prefetch(tp.AUTOTUNE)  # one Dataset: its cache persists
        knobs = {"num_parallel_calls": cores, "executor": "thread"}
        self.chosen["torchpipe_cache"] = knobs
        return [self.trial("torchpipe_cache_epoch1", lambda: pipeline, knobs),
                self.trial("torchpipe_cache_epoch2", lambda: pipeline, "replays the decoded images")]  # fmt: skip

    def dependent(self) -> list[Trial]:
        """The configurations made from the first rounds' medians: ``torchpipe_dataloader`` with
        ``dataloader_best``'s arguments, and the budgeted loader (``BUDGETED`` workloads)."""
        trials = []
        best = self.chosen.get(BASELINE)
        if best is not None and self.work.name != "cache":
            dataset, kwargs = self.work.dataset, self.work.loader_kwargs(best["num_workers"])
            trials.append(self.trial("torchpipe_dataloader", partial(tp.DataLoader, dataset, **best, **kwargs), best))
        if self.work.name in BUDGETED and not self.work.epochs:
            trials += self.budget_trial()
        return self.with_twins(trials)

    def grid_pss(self) -> None:
        """torch's end PSS by worker count (``prefetch_factor=2``; the memory target's reference)
        and every DataLoader grid point's summary (the budget's reference), from the medians."""
        for args, result in self.grid:
            if args["num_workers"] == 0 or args.get("prefetch_factor") == 2:
                self.dataloader_pss[args["num_workers"]] = result.get("end_pss_mb")
                self.dataloader_held[args["num_workers"]] = result.get("end_held_mb")

    def budget_trial(self) -> list[Trial]:
        """``tp.DataLoader("auto")`` under a RAM budget that binds: halfway between the tree's end
        PSS without workers (``dataloader_default``) and ``torchpipe_dataloader_auto``'s, so its
        unconstrained choice does not fit and some parallelism may; held to the fastest
        DataLoader configuration that ends within it."""
        base = self.dataloader_pss.get(0)
        unconstrained = self.results.get("torchpipe_dataloader_auto", {}).get("end_pss_mb")
        if base is None or unconstrained is None or unconstrained <= base:
            return []
        total = (base + unconstrained) / 2
        fitting = [(a, r) for a, r in self.grid if r.get("end_pss_mb") is not None and r["end_pss_mb"] <= total]
        best_args, best = max(fitting, key=lambda pair: pair[1]["throughput"], default=({}, {"throughput": None}))
        options = tp.AutotuneOptions(ram_budget=(total - base) * 2**20)
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs("auto")
        self.budget = {"pss_mb": total, "ram_budget_mb": total - base, "best_args": best_args,
                       "best_throughput": best["throughput"]}  # fmt: skip
        knobs = (f"ram_budget={total - base:.0f} MB: the tree at {total:.0f} MB, "
                 f"halfway from {base:.0f} MB without workers")  # fmt: skip
        make = partial(tp.DataLoader, dataset, num_workers="auto", autotune=options, **kwargs)
        return [self.trial(BUDGET_CONFIG, make, knobs)]

    def peer_trials(self, last: bool) -> list[Trial]:
        """The installed peers' configurations (those in ``LAST`` when ``last``, the others when
        not); on an epochs workload, each through its adapter's epochs (workers kept across
        epochs where the library can keep them). A library whose configurations cannot be made
        is reported (in the JSON under ``workloads.<name>.peer_errors``) and left out."""
        trials: list[Trial] = []
        for peer in pr.PEERS if self.peers else ():
            if not peer.installed() or (peer.library in LAST) != last:
                continue
            if peer.workloads is not None and self.work.name not in peer.workloads:
                continue
            try:
                configs = peer.configs(self.work, self.quick)
            except Exception as e:  # noqa: BLE001 - one peer's failure must not hide the others' numbers
                self.peer_failed(peer.library, e)
                continue
            for config in configs:
                make = config.epochs if self.work.epochs else config.make
                if make is None:
                    self.not_measured[config.name or peer.library] = NOT_MEASURED_EPOCHS
                    continue
                key = f"{peer.library} {config.name or ''} {config.knobs}"
                best = f"{peer.library}_best" if config.in_best else None
                trials.append(Trial(key, partial(self.measure_one, make), name=config.name, best_of=best,
                                    knobs=config.knobs, group=peer.library))  # fmt: skip
        return trials

    def peer_failed(self, library: str, error: BaseException) -> None:
        self.errors[library] = f"{type(error).__name__}: {error}"
        print(f"  {library} failed on {self.work.name}: {self.errors[library]}", flush=True)

    def measure_rounds(self, plan: Callable[[], list[Trial]]) -> None:
        """``repeat`` rounds of ``plan()``'s configurations; their medians join the results."""
        done = run_rounds(plan, self.repeat, self.printed, lambda trial, e: self.peer_failed(str(trial.group), e))
        results, chosen = rounds_report(done)
        for key, trial in done.trials.items():
            if trial.best_of == BASELINE:
                self.grid.append((trial.knobs, summarize(done.runs[key])))
        self.results.update(results)
        self.chosen.update(chosen)
        names = {trial.name: trial.knobs for trial in done.trials.values() if trial.name} | chosen
        for config in sorted(results, key=_rank):
            self.record(config, results[config], str(names.get(config, "")))

    def printed(self, k: int, trial: Trial, result: dict[str, Any]) -> None:
        """One measurement as it is made."""
        label = trial.name or f"grid {trial.knobs}"
        lap = f"[{k + 1}/{self.repeat}] " if self.repeat > 1 else ""
        print(f"    {lap}{label}: {result['throughput']:.4g}", flush=True)

    def record(self, config: str, result: dict[str, Any], note: str = "") -> None:
        """One configuration's median (and spread) as the log shows it."""
        spread = f" spread {_share(result.get('spread'))}" if self.repeat > 1 else ""
        print(f"  {config:<26} {result['throughput']:>12.4g} {self.work.unit:<9}{spread} {note}", flush=True)
        if "epoch_rates" in result:
            print(f"    {_epochs(result)}", flush=True)


def _rank(config: str) -> int:
    return ORDER.index(config) if config in ORDER else len(ORDER)


def _under_legacy_rings(measure_once: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure_once()`` with the ring policy before slot rings (read as a pool starts)."""
    before = os.environ.get(RING_POLICY_ENV)
    os.environ[RING_POLICY_ENV] = LEGACY
    try:
        return measure_once()
    finally:
        if before is None:
            del os.environ[RING_POLICY_ENV]
        else:
            os.environ[RING_POLICY_ENV] = before


def ring_ab_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each row that has a ``--ring-ab`` twin: its throughput and end PSS as ratios to the twin's
    (``speed``: >= 0.95 holds issue #41's "speed held"; ``pss``: below 1 holds less)."""
    out = {}
    for config, mine in results.items():
        twin = results.get(config + LEGACY_RINGS)
        if twin is None:
            continue
        pss, theirs = mine.get("end_pss_mb"), twin.get("end_pss_mb")
        out[config] = {"speed": mine["throughput"] / twin["throughput"] if twin["throughput"] else None,
                       "pss": pss / theirs if pss is not None and theirs else None}  # fmt: skip
    return out


def format_ring_ab(report: dict[str, Any]) -> str:
    """The ``--ring-ab`` ratios, a line a row (empty where the run measured none)."""
    lines = []
    for name, entry in report["workloads"].items():
        for config, r in entry.get("ring_ab", {}).items():
            if r["speed"] is not None:
                pss = f", end PSS {r['pss']:.2f}x" if r["pss"] is not None else ""
                lines.append(f"  {name}/{config}: speed {r['speed']:.2f}x{pss}")
    return "\n".join(["slot rings against the legacy ring policy (speed held: >= 0.95x):", *lines]) if lines else ""


def dsl_pipeline(work: wl.Workload, parallel: Any, executor: str) -> tp.Dataset:
    """The workload's pipeline in the DSL, batched, with ``prefetch(tp.AUTOTUNE)``."""
    return work.batched(parallel, executor).prefetch(tp.AUTOTUNE)


def torch_loader(dataset: Any, args: dict[str, Any], kwargs: dict[str, Any]) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, **args, **kwargs)


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


def run_all(names: list[str], quick: bool, sizes: wl.Sizes | None = None, repeat: int = 1, ring_ab: bool = False,
            peers: bool = True) -> dict[str, Any]:  # fmt: skip
    """Measure ``names``, each configuration ``repeat`` times in alternating rounds, and return
    the report (the JSON document). ``ring_ab``: every torchpipe row also under the legacy ring
    policy; ``peers``: False leaves the peers out.

    Raises:
        ValueError: if ``repeat`` is below 1.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    sizes = sizes or (wl.QUICK if quick else wl.FULL)
    report: dict[str, Any] = {"machine": machine(quick), "workloads": {}}
    run_info = report["machine"]["run"]
    run_info.update(repeat=repeat, chosen={}, limit_notes={}, peers=pr.notes())
    for library, note in run_info["peers"].items():
        print(f"{library}: {note}", flush=True)
    runners = []
    for name in names:
        work = suite.WORKLOADS[name](sizes, quick)
        limit = "null" if work.limit is None else f"{work.limit:.4g} {work.unit}"
        extra = "".join(f", {key} {value}" for key, value in work.extra.items())
        print(f"\n{name}: batch {work.batch_size}, limit {limit} ({work.limit_note}){extra}", flush=True)
        runner = Runner(work, sizes, quick, repeat, ring_ab, peers)
        runner.run()
        runners.append(runner)
    for runner in runners:
        if peers and any(peer.installed() and peer.library in LAST for peer in pr.PEERS):
            print(f"\n{runner.work.name}, measured last: {', '.join(LAST)}", flush=True)
            runner.measure_rounds(partial(runner.peer_trials, last=True))
    for runner in runners:
        work = runner.work
        report["workloads"][work.name] = {"unit": work.unit, "limit": work.limit, "results": runner.results,
                                          "targets": targets(work.name, runner.results, runner.dataloader_pss,
                                                             runner.budget, runner.dataloader_held),
                                          "placement": placements(runner.results),
                                          "budget": runner.budget,
                                          "dataloader_pss": {str(k): v for k, v in runner.dataloader_pss.items()},
                                          "dataloader_held": {str(k): v for k, v in runner.dataloader_held.items()},
                                          "ring_ab": ring_ab_ratios(runner.results),
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


def _spread(result: dict[str, Any]) -> str:
    """``(max - min) / median`` of a result's throughputs, where it has more than one run."""
    return _share(result.get("spread")) if len(result.get("runs", ())) > 1 else "-"


def table(report: dict[str, Any]) -> str:
    """The printed summary: throughput, ratios against dataloader_best and the limit, and costs;
    every number is the median of the configuration's runs, and ``spread`` is ``(max - min) /
    median`` of their throughputs (``-`` for one run). ``others`` is the share of the cores other
    processes took during the measurement. On an epochs workload (``blobs``) the throughput is the
    whole run's rate, each epoch's rate follows on a line of its own, and a peer configuration that
    was not measured says so."""
    lines = []
    header = (f"{'workload':<10} {'config':<25} {'throughput':>11} {'unit':<9} {'spread':>6} {'vs DL best':>10} "
              f"{'vs limit':>8} {'1st batch':>9} {'peak RSS':>9} {'end PSS':>8} {'CPU/item':>10} "
              f"{'others':>6}")  # fmt: skip
    lines += [header, "-" * len(header)]
    for name, entry in report["workloads"].items():
        results, limit = entry["results"], entry["limit"]
        base = results.get("dataloader_best", {}).get("throughput")
        for config in sorted(results, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
            r = results[config]
            vs_best = f"{r['throughput'] / base:.2f}x" if base else "-"
            vs_limit = f"{r['throughput'] / limit:.2f}" if limit else "-"
            lines.append(
                f"{name:<10} {config:<25} {r['throughput']:>11.4g} {entry['unit']:<9} {_spread(r):>6} {vs_best:>10} "
                f"{vs_limit:>8} "
                f"{r['first_batch_s']:>8.2f}s {r['peak_rss_mb']:>7.0f}MB {_megabytes(r.get('end_pss_mb')):>8} "
                f"{r['cpu_s_per_item'] * 1e3:>8.3f}ms"
                f" {_share(r.get('others_cpu_share')):>6}"
            )
            if "epoch_rates" in r:
                lines.append(f"{'':<10} {'':<25} {_epochs(r)}")
        for library, why in entry.get("not_measured", {}).items():
            lines.append(f"{name:<10} {library:<25} {'not measured':>11} ({why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small data and small grids, each configuration measured for 1 s + 4 s: about 25 minutes "
        "on 2 cores with every peer installed (x3 with --repeat 3)",
    )
    parser.add_argument(
        "--workloads", default=",".join(suite.WORKLOADS), help=f"comma-separated, from {list(suite.WORKLOADS)}"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each configuration this many times, alternating (A B C A B C), and report medians: "
        "the run takes about as many times as long",
    )
    parser.add_argument(
        "--ring-ab", action="store_true", help="every torchpipe row also under the ring policy before slot rings"
    )
    parser.add_argument("--no-peers", action="store_true", help="leave the peers out")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in suite.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(suite.WORKLOADS)}")
    start = time.perf_counter()
    report = run_all(names, args.quick, repeat=args.repeat, ring_ab=args.ring_ab, peers=not args.no_peers)
    report["machine"]["run"]["seconds"] = round(time.perf_counter() - start, 1)
    print()
    if args.quick:
        grid = ", ".join(f"{g['num_workers']}/{g['prefetch_factor']}" for g in dataloader_grid(True))
        print(f"--quick: smaller data, smaller grids; DataLoader grid num_workers/prefetch_factor {grid}")
    for config, note in report["machine"]["run"]["peers"].items():
        print(f"{config}: {note}")
    print(table(report))
    print()
    print(format_targets(report))
    if args.ring_ab:
        print(format_ring_ab(report))
    print(f"\n{report['machine']['run']['seconds']:.0f} s in all; usable cores: {usable_cpu_count()}")
    write_report(report, args.json)


def write_report(report: dict[str, Any], path: str | None) -> None:
    """Write ``report`` as JSON to ``path`` and say so (nothing where ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

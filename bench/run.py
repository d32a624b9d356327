"""The benchmark suite: torchpipe against torch's DataLoader and the peers, side by side.

Every configuration of a workload runs the same per-item work with the same batch size, one
after another, each in a fresh process forked from this one, which measures nothing itself
(``bench/isolate.py``), so their ratios are comparable (absolute numbers from different runs are
not: machines are noisy). Synthetic data is generated once into
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

``--no-peers`` leaves the peers out (a run about torchpipe alone).

``--repeat N`` measures every configuration N times, alternating configurations within the
run (A B C A B C ...: ``bench/rounds.py``); each row is then the median of its runs with their
spread, the JSON keeps every run's values (``results.<config>.runs``), and every ratio and
target verdict is computed from the medians (issue #42).

After the table, the two zero-knob configurations (torchpipe_dataloader_auto, torchpipe_auto)
are checked against their targets (``bench/targets.py``), and where each ran and what its
placement policy measured is printed beside them; the JSON has the same under
``workloads.<name>.targets`` and ``workloads.<name>.placement``.

Without ``--workloads`` a run measures ``bench/suite.py``'s ``DEFAULT``: every workload but the
training-transform ones (``train_jpeg``, ``train_tfrecord``: RandomResizedCrop, flip, normalize on
photo-like JPEGs, ``bench/training.py``), which keep the default full run within its 45 minutes
(issue #57). Run them with ``--workloads train_jpeg,train_tfrecord``.

Run: python bench/run.py [--quick] [--repeat 3] [--workloads jpeg,bigtensor,...] [--no-peers]
                        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench import cuts, suite, tpimage
from bench import peers as pr
from bench import report as rp
from bench import workloads as wl
from bench.isolate import TIMEOUT_S, preload, pristine_parent
from bench.measure import measure, measure_epochs
from bench.report import ORDER, table, write_report
from bench.rounds import Trial, run_rounds, summarize
from bench.rounds import report as rounds_report
from bench.targets import (
    BASELINE,
    BUDGET_CONFIG,
    TORCHPIPE_BEST,
    TWINS,
    ZERO_KNOB,
    floor,
    format_targets,
    placements,
    targets,
)
from torchpipe.runtime.cpu import usable_cpu_count

LAST = ("tfdata",)
"""Peers measured after every workload's other configurations: the parent imports TensorFlow
once, then forks their rows (``bench/isolate.py``'s :func:`~bench.isolate.preload`)."""
QUICK_ROW_S = 120.0
"""How long one ``--quick`` measurement may take before it is killed and recorded as failed (with
where its threads were): a row takes ~5-15 s; one that hangs must not hold the run for the
``TIMEOUT_S`` a full run's epochs may need (the last full run lost 600 s to one hung row)."""
BUDGETED = ("jpeg", "bigtensor", "tfrecord")
"""Workloads with large batches, where ``tp.DataLoader("auto")`` is also measured under a RAM budget."""
NOT_MEASURED_EPOCHS = "its adapter runs no epochs (it makes one pass over other work)"
"""Why a peer's configuration has no row on an epochs workload (``blobs``)."""
NOT_MEASURED_GRID = "its adapter has no configuration on this workload"
"""Why a peer has no row on a workload it is installed for (its grid there is empty)."""
__all__ = ["ORDER", "table", "write_report"]


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
    return [{"num_workers": n, "prefetch_factor": 2} for n in workers] + [
        {"num_workers": cores, "prefetch_factor": 4}
    ]


class Runner:
    """Measures the configurations of one workload in rounds and remembers what was chosen.

    A round (``bench/rounds.py``) measures every configuration of a phase once, each in a fresh
    process; ``repeat`` rounds alternate them (A B C A B C). The first phase is torch's DataLoader
    grid (``dataloader_best`` is its best); the second every other configuration, with
    ``torchpipe_dataloader`` at ``dataloader_best``'s arguments and ``TWINS`` twins of
    ``dataloader_best`` (the noise floor, ``bench/targets.py``), in the same rounds as the
    zero-knob rows; the third the budgeted loader, whose budget the second's memory sets. The
    peers in ``LAST`` are measured after every workload.
    """

    def __init__(
        self,
        work: wl.Workload,
        sizes: wl.Sizes,
        quick: bool,
        repeat: int = 1,
        peers: bool = True,
        fresh: bool = True,
    ) -> None:
        self.work, self.sizes, self.quick, self.repeat = work, sizes, quick, repeat
        self.peers, self.fresh = peers, fresh
        self.results: dict[str, dict[str, Any]] = {}
        self.chosen: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.failed: dict[
            str, list[str]
        ] = {}  # rows (without a peer group) that failed, each failure
        self.fresh_process_s = 0.0  # run time the fresh processes cost, over the measurements' own
        self.not_measured: dict[str, str] = dict(work.not_measured)
        self.cut: list[str] = []  # grid points a --quick run leaves out (bench/cuts.py)
        self.dataloader_pss: dict[
            int, float | None
        ] = {}  # torch's end PSS by num_workers, prefetch_factor=2
        self.dataloader_held: dict[
            int, float | None
        ] = {}  # and what it held, shared memory counted once
        self.dataloader_peak: dict[int, float | None] = {}  # and what it held at its peak
        self.dataloader_growth: dict[int, float | None] = {}  # and what it added at its peak
        self.grid: list[
            tuple[dict[str, int], dict[str, Any]]
        ] = []  # every DataLoader configuration measured
        self.budget: dict[str, Any] | None = None  # the RAM budget's check (BUDGETED workloads)
        # cache measures whole epochs, blobs several on one loader, every other workload a timed window
        self.measure_one = (
            self.epoch if work.name == "cache" else self.epochs if work.epochs else self.timed
        )

    def epochs(self, make: Callable[[], Any]) -> dict[str, Any]:
        """``work.epochs`` whole epochs of one loader (the ``blobs`` workload's measure)."""
        return measure_epochs(make, self.work.count, self.work.epochs)

    def timed(self, make: Callable[[], Any], seconds: float | None = None) -> dict[str, Any]:
        """A timed window of ``seconds`` (the workload's sizes' by default) after the warm-up."""
        return measure(make, self.work.count, self.sizes.warmup_s, seconds or self.sizes.seconds)

    def steady(self, make: Callable[[], Any]) -> dict[str, Any]:
        """A zero-knob row's measure: the timed window made long enough that its placement's trials
        are over (``sizes.steady_s``); the workload's own measure where it measures epochs."""
        if self.measure_one != self.timed:
            return self.measure_one(make)
        return self.timed(make, self.sizes.steady_s)

    def epoch(self, make: Callable[[], Any]) -> dict[str, Any]:
        """One whole epoch, from ``iter()`` to its end (the ``cache`` workload's measure)."""
        return measure(make, self.work.count, 0.0, math.inf, whole_epoch=True)

    def trial(self, name: str, make: Callable[[], Any], knobs: Any, **kwargs: Any) -> Trial:
        """A configuration measured by this workload's measure, a zero-knob one by :meth:`steady`
        (``kwargs``: :class:`Trial`'s)."""
        measure_one = self.steady if name in ZERO_KNOB else self.measure_one
        return Trial(name, partial(measure_one, make), name=name, knobs=knobs, **kwargs)

    def run(self) -> None:
        """Every configuration of the workload, but those measured last (``LAST``)."""
        self.measure_rounds(self.dataloader_trials)
        self.grid_pss()
        self.measure_rounds(self.plan)
        self.measure_rounds(self.budget_trial)

    def plan(self) -> list[Trial]:
        """One round's configurations after torch's grid, in order (see the class docstring)."""
        work, trials = self.work, []
        dataset = work.dataset if work.auto_dataset is None else work.auto_dataset
        kwargs = work.loader_kwargs("auto")
        auto_loader = partial(tp.DataLoader, dataset, num_workers="auto", **kwargs)
        trials.append(self.trial("torchpipe_dataloader_auto", auto_loader, "num_workers='auto'"))
        if work.name == "cache":
            trials += self.cache_trials()
        else:
            auto = "num_parallel_calls=AUTOTUNE, executor='auto', prefetch(AUTOTUNE)"
            trials.append(
                self.trial("torchpipe_auto", partial(dsl_pipeline, work, tp.AUTOTUNE, "auto"), auto)
            )
        if not work.epochs and work.name != "cache":
            for parallel, executor in work.tp_grid:
                knobs = {"num_parallel_calls": parallel, "executor": executor}
                if not self.kept(TORCHPIPE_BEST, knobs):
                    continue
                make = partial(dsl_pipeline, work, parallel, executor)
                trials.append(
                    Trial(
                        f"torchpipe {knobs}",
                        partial(self.timed, make),
                        best_of="torchpipe_best",
                        knobs=knobs,
                    )
                )
            if work.name in tpimage.PIPELINES:
                knobs = "tp.image ops, num_parallel_calls=AUTOTUNE, prefetch(AUTOTUNE)"
                trials.append(self.trial(tpimage.CONFIG, partial(tpimage.batched, work), knobs))
        return trials + self.dependent() + self.twins() + self.peer_trials(last=False)

    def kept(self, best: str, knobs: Any) -> bool:
        """Whether this run measures the grid point ``knobs`` of ``best`` (``bench/cuts.py``); the
        first round notes each point it leaves out in ``cut``."""
        if cuts.kept(self.work.name, best, knobs, self.quick):
            return True
        point = f"{best} {knobs}"
        if point not in self.cut:
            self.cut.append(point)
        return False

    def twins(self) -> list[Trial]:
        """``TWINS`` rows of ``dataloader_best``'s configuration (``dataloader_best_twin1``, ...): the
        noise floor's measure (``bench/targets.py``'s :func:`~bench.targets.floor`)."""
        best = self.chosen.get(BASELINE)
        if best is None:
            return []
        make = partial(
            torch_loader, self.work.dataset, best, self.work.loader_kwargs(best["num_workers"])
        )
        return [self.trial(name, make, best) for name in TWINS]

    def dataloader_trials(self) -> list[Trial]:
        """``dataloader_default`` and the grid ``dataloader_best`` is the best of (default included)."""
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs
        default = self.trial(
            "dataloader_default",
            partial(torch_loader, dataset, {"num_workers": 0}, kwargs(0)),
            {"num_workers": 0},
            best_of=BASELINE,
        )
        grid = []
        for args in dataloader_grid(self.quick):
            if not self.kept(BASELINE, args):
                continue
            make = partial(torch_loader, dataset, args, kwargs(args["num_workers"]))
            grid.append(
                Trial(
                    f"dataloader {args}",
                    partial(self.measure_one, make),
                    best_of=BASELINE,
                    knobs=args,
                )
            )
        return [default, *grid]

    def cache_trials(self) -> list[Trial]:
        """torchpipe's epochs 1 and 2 of one cached pipeline (made afresh each round)."""
        cores = usable_cpu_count()
        # one Dataset: its cache persists
        pipeline = self.work.batched(cores, "thread").prefetch(tp.AUTOTUNE)
        knobs = {"num_parallel_calls": cores, "executor": "thread"}
        self.chosen["torchpipe_cache"] = knobs
        return [
            self.trial(
                "torchpipe_cache_epoch1", lambda: pipeline, knobs, together="torchpipe_cache"
            ),
            self.trial(
                "torchpipe_cache_epoch2",
                lambda: pipeline,
                "replays the decoded images",
                together="torchpipe_cache",
            ),
        ]

    def dependent(self) -> list[Trial]:
        """``torchpipe_dataloader``: ``tp.DataLoader`` with ``dataloader_best``'s arguments."""
        best = self.chosen.get(BASELINE)
        if best is None or self.work.name == "cache":
            return []
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs(best["num_workers"])
        return [
            self.trial(
                "torchpipe_dataloader", partial(tp.DataLoader, dataset, **best, **kwargs), best
            )
        ]

    def grid_pss(self) -> None:
        """torch's peak held memory by worker count (``prefetch_factor=2``; the memory target's
        reference; its end PSS and end held beside it, for reference), from the medians."""
        for args, result in self.grid:
            if args["num_workers"] == 0 or args.get("prefetch_factor") == 2:
                self.dataloader_pss[args["num_workers"]] = result.get("end_pss_mb")
                self.dataloader_held[args["num_workers"]] = result.get("end_held_mb")
                self.dataloader_peak[args["num_workers"]] = result.get("peak_held_mb")
                self.dataloader_growth[args["num_workers"]] = result.get("peak_growth_mb")

    def budget_trial(self) -> list[Trial]:
        """``tp.DataLoader("auto")`` under a RAM budget that binds (``BUDGETED`` workloads): what
        the loader adds to the tree at its peak halfway between torch's without workers
        (``dataloader_default``) and ``torchpipe_dataloader_auto``'s, so its unconstrained choice
        does not fit and some parallelism may; held to the fastest DataLoader configuration whose
        peak fits it.

        The loader's ``ram_budget`` is that growth over the tree before it (each row process's
        first reading): what the loader may hold of its own, its calls' heap in this process
        included (issue #58's rule). Growth, not the tree's peak: a row's tree before the loader
        moves with its parent's (the peers imported there added ~200 MB to the rows after them).
        """
        if self.work.name not in BUDGETED or self.work.epochs:
            return []
        base = self.dataloader_growth.get(0)
        unconstrained = self.results.get("torchpipe_dataloader_auto", {}).get("peak_growth_mb")
        if base is None or unconstrained is None or unconstrained <= base:
            return []
        own = (base + unconstrained) / 2
        fitting = [
            (a, r)
            for a, r in self.grid
            if r.get("peak_growth_mb") is not None and r["peak_growth_mb"] <= own
        ]
        best_args, best = max(
            fitting, key=lambda pair: pair[1]["throughput"], default=({}, {"throughput": None})
        )
        options = tp.AutotuneOptions(ram_budget=own * 2**20)
        dataset, kwargs = self.work.dataset, self.work.loader_kwargs("auto")
        self.budget = {
            "growth_mb": own,
            "ram_budget_mb": own,
            "best_args": best_args,
            "best_throughput": best["throughput"],
        }
        knobs = (
            f"ram_budget={own:.0f} MB at its peak over the tree before the loader, halfway from "
            f"{base:.0f} MB without workers"
        )
        make = partial(tp.DataLoader, dataset, num_workers="auto", autotune=options, **kwargs)
        return [self.trial(BUDGET_CONFIG, make, knobs)]

    def peer_trials(self, last: bool) -> list[Trial]:
        """The installed peers' configurations (those in ``LAST`` when ``last``, the others when
        not); on an epochs workload, each through its adapter's epochs (workers kept across
        epochs where the library can keep them). A library whose configurations cannot be made
        is reported (in the JSON under ``workloads.<name>.peer_errors``) and left out; one with no
        configuration here is listed under ``not_measured``, with why. Configurations that share
        one pipeline (tf.data's cache epochs) are measured in one process."""
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
            if not configs:
                self.not_measured[peer.library] = NOT_MEASURED_GRID
            for config in configs:
                make = config.epochs if self.work.epochs else config.make
                if make is None:
                    self.not_measured[config.name or peer.library] = NOT_MEASURED_EPOCHS
                    continue
                key = f"{peer.library} {config.name or ''} {config.knobs}"
                best = f"{peer.library}_best" if config.in_best else None
                if best is not None and not self.kept(best, config.knobs):
                    continue  # tfdata_autotune too: it never won tfdata_best (bench/cuts.py)
                trials.append(
                    Trial(
                        key,
                        partial(self.measure_one, make),
                        name=config.name,
                        best_of=best,
                        knobs=config.knobs,
                        group=peer.library,
                        together=f"{peer.library} {id(make)}",
                    )
                )
        return trials

    def peer_failed(self, library: str, error: BaseException) -> None:
        self.errors[library] = f"{type(error).__name__}: {error}"
        print(f"  {library} failed on {self.work.name}: {self.errors[library]}", flush=True)

    def row_failed(self, trial: Trial, error: BaseException) -> None:
        """A measurement that raised: a peer's drops its library, any other row's is recorded."""
        if trial.group is not None:
            self.peer_failed(trial.group, error)
        else:
            print(
                f"  {trial.name or trial.key} failed on {self.work.name}: {str(error).splitlines()[0]}",
                flush=True,
            )

    def measure_rounds(self, plan: Callable[[], list[Trial]]) -> None:
        """``repeat`` rounds of ``plan()``'s configurations; their medians join the results, their
        failures ``failed``, the fresh processes' cost ``fresh_process_s``."""
        timeout_s = QUICK_ROW_S if self.quick else TIMEOUT_S
        done = run_rounds(
            plan, self.repeat, self.printed, self.row_failed, fresh=self.fresh, timeout_s=timeout_s
        )
        for key, failures in done.failed.items():
            self.failed.setdefault(key, []).extend(failures)
        runs = [run for runs in done.runs.values() for run in runs]
        self.fresh_process_s += sum(
            max(0.0, run["row_wall_s"] - run["measure_s"]) for run in runs if self.fresh
        )
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
        early = " (its data ended inside the window)" if result.get("ended_early") else ""
        print(f"    {lap}{label}: {result['throughput']:.4g}{early}", flush=True)

    def record(self, config: str, result: dict[str, Any], note: str = "") -> None:
        """One configuration's median (and spread) as the log shows it."""
        spread = f" spread {rp._share(result.get('spread'))}" if self.repeat > 1 else ""
        print(
            f"  {config:<26} {result['throughput']:>12.4g} {self.work.unit:<9}{spread} {note}",
            flush=True,
        )
        if "epoch_rates" in result:
            print(f"    {rp._epochs(result)}", flush=True)


def _rank(config: str) -> int:
    return ORDER.index(config) if config in ORDER else len(ORDER)


def dsl_pipeline(work: wl.Workload, parallel: Any, executor: str) -> tp.Dataset:
    """The workload's pipeline in the DSL, batched, with ``prefetch(tp.AUTOTUNE)``."""
    return work.batched(parallel, executor).prefetch(tp.AUTOTUNE)


def torch_loader(
    dataset: Any, args: dict[str, Any], kwargs: dict[str, Any]
) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, **args, **kwargs)


def machine(quick: bool) -> dict[str, Any]:
    """What the numbers were measured on (``bench/report.py``'s :func:`~bench.report.machine`)."""
    return rp.machine(quick, dataloader_grid(quick))


def run_all(
    names: list[str],
    quick: bool,
    sizes: wl.Sizes | None = None,
    repeat: int = 1,
    peers: bool = True,
    fresh: bool = True,
) -> dict[str, Any]:
    """Measure ``names``, each configuration ``repeat`` times in alternating rounds, and return
    the report (the JSON document). ``peers``: False leaves the peers out; ``fresh``: False measures every row in this
    process (tests that watch a measurement from the inside, or whose process has run torch's
    OpenMP pool already: ``bench/isolate.py``).

    Raises:
        ValueError: if ``repeat`` is below 1.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    with pristine_parent() if fresh else contextlib.nullcontext():
        return _run_all(
            names, quick, sizes or (wl.QUICK if quick else wl.FULL), repeat, peers, fresh
        )


def _run_all(
    names: list[str], quick: bool, sizes: wl.Sizes, repeat: int, peers: bool, fresh: bool
) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(quick), "workloads": {}}
    run_info = report["machine"]["run"]
    run_info.update(repeat=repeat, chosen={}, limit_notes={}, peers=pr.notes(), fresh_process=fresh)
    for library, note in run_info["peers"].items():
        print(f"{library}: {note}", flush=True)
    runners = []
    for name in names:
        work = suite.WORKLOADS[name](sizes, quick)
        limit = "null" if work.limit is None else f"{work.limit:.4g} {work.unit}"
        extra = "".join(f", {key} {value}" for key, value in work.extra.items())
        print(
            f"\n{name}: batch {work.batch_size}, limit {limit} ({work.limit_note}){extra}",
            flush=True,
        )
        runner = Runner(work, sizes, quick, repeat, peers, fresh)
        runner.run()
        runners.append(runner)
    last = [peer for peer in pr.PEERS if peers and peer.library in LAST and peer.installed()]
    for peer in last:  # imported once here, not in each of their rows' processes (bench/isolate.py)
        run_info.setdefault("preloaded_s", {})[peer.library] = round(preload(peer.imported), 1)
    for runner in runners:
        if last:
            print(f"\n{runner.work.name}, measured last: {', '.join(LAST)}", flush=True)
            runner.measure_rounds(partial(runner.peer_trials, last=True))
    for runner in runners:
        report["workloads"][runner.work.name] = entry(runner)
        run_info["chosen"][runner.work.name] = runner.chosen
        run_info["limit_notes"][runner.work.name] = runner.work.limit_note
    run_info["fresh_process_s"] = round(sum(runner.fresh_process_s for runner in runners), 1)
    return report


def entry(runner: Runner) -> dict[str, Any]:
    """One workload's part of the report."""
    work, results = runner.work, runner.results
    peaks = {
        "end_pss_mb": runner.dataloader_pss,
        "end_held_mb": runner.dataloader_held,
        "peak_held_mb": runner.dataloader_peak,
        "peak_growth_mb": runner.dataloader_growth,
    }
    return {
        "unit": work.unit,
        "limit": work.limit,
        "results": results,
        "targets": targets(work.name, results, peaks, runner.budget),
        "floor": floor(results),
        "placement": placements(results),
        "budget": runner.budget,
        "dataloader_pss": {str(k): v for k, v in runner.dataloader_pss.items()},
        "dataloader_held": {str(k): v for k, v in runner.dataloader_held.items()},
        "dataloader_peak": {str(k): v for k, v in runner.dataloader_peak.items()},
        "dataloader_growth": {str(k): v for k, v in runner.dataloader_growth.items()},
        "extra": work.extra,
        "peer_errors": runner.errors,
        "failed": runner.failed,
        "not_measured": runner.not_measured,
        "cut": runner.cut,
        "fresh_process_s": round(runner.fresh_process_s, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small data and small grids, each configuration measured for 1 s + 4 s (zero-knob rows 1 s + 6 s), "
        "each in a fresh process (x3 with --repeat 3)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(suite.DEFAULT),
        help=f"comma-separated, from {list(suite.WORKLOADS)}; default: all but the training-transform ones "
        f"{list(suite.TRAINING)}, run with --workloads {','.join(suite.TRAINING)}",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each configuration this many times, alternating (A B C A B C), and report medians: "
        "the run takes about as many times as long",
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
    report = run_all(names, args.quick, repeat=args.repeat, peers=not args.no_peers)
    report["machine"]["run"]["seconds"] = round(time.perf_counter() - start, 1)
    print()
    if args.quick:
        grid = ", ".join(
            f"{g['num_workers']}/{g['prefetch_factor']}" for g in dataloader_grid(True)
        )
        print(
            f"--quick: smaller data, smaller grids; DataLoader grid num_workers/prefetch_factor {grid}"
        )
    for config, note in report["machine"]["run"]["peers"].items():
        print(f"{config}: {note}")
    print(table(report))
    print()
    print(format_targets(report))
    run = report["machine"]["run"]
    print(
        f"\n{run['seconds']:.0f} s in all ({run['fresh_process_s']:.0f} s of it the fresh processes' cost); "
        f"usable cores: {usable_cpu_count()}"
    )
    write_report(report, args.json)


if __name__ == "__main__":
    main()

"""The noise floor of the bench's "best of any loader" verdict: one configuration measured as K twins.

``bench/run.py`` holds each zero-knob row to the best of the K configurations that do the same
work, each the median of its runs. On a shared machine the highest of K medians sits above what
any one configuration runs at, so even a row identical to the best reads below it. This measures
by how much: one configuration (torch's DataLoader with ``--num-workers``) as ``--twins`` K rows,
each measured ``--repeat`` times in alternating rounds exactly as run.py measures its rows (same
windows, same sizes), then each twin's median over the highest twin's median. ``at_target`` is the
share of twins at or above ``vs_best_of_any``'s ratio: how often a row doing exactly what the best
row does would meet that target on this machine today.

Run: python bench/noise.py [--workloads jpeg,records,tiny] [--twins 9] [--repeat 3] [--num-workers 2]
                           [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import suite
from bench import workloads as wl
from bench.isolate import pristine_parent
from bench.rounds import Trial, run_rounds
from bench.run import Runner, machine, torch_loader, write_report
from bench.targets import TARGETS

_BOUND = next(t.bound for t in TARGETS if t.key == "vs_best_of_any")
assert _BOUND is not None  # a target with a bound
VS_BEST_OF_ANY: float = _BOUND
"""The ratio a zero-knob row must reach against the best of any loader (0.95)."""


def twin_trials(work: wl.Workload, sizes: wl.Sizes, twins: int, num_workers: int) -> list[Trial]:
    """``twins`` rows of one configuration (torch's DataLoader, ``num_workers``, prefetch_factor 2
    with workers), each measured by the workload's measure in run.py."""
    if twins < 2:
        raise ValueError(
            f"twins must be at least 2 (one row has no best to be held to), got {twins}"
        )
    if num_workers < 0:
        raise ValueError(f"num_workers must be at least 0, got {num_workers}")
    args: dict[str, Any] = {
        "num_workers": num_workers,
        **({"prefetch_factor": 2} if num_workers else {}),
    }
    make = partial(torch_loader, work.dataset, args, work.loader_kwargs(num_workers))
    measure_one = Runner(work, sizes, quick=True).measure_one
    return [
        Trial(f"twin{k}", partial(measure_one, make), name=f"twin{k}", knobs=args)
        for k in range(twins)
    ]


def floor(throughputs: dict[str, list[float]], target: float = VS_BEST_OF_ANY) -> dict[str, Any]:
    """Each twin's median throughput over the highest twin's median (``ratios``), their lowest
    and median, the share of twins at or above ``target`` (``at_target``), and each twin's spread
    ((max - min) / median of its runs).

    Raises:
        ValueError: for fewer than two twins, or a twin without runs.
    """
    if len(throughputs) < 2 or not all(throughputs.values()):
        raise ValueError(f"need at least two twins, each with runs: {throughputs}")
    medians = {name: statistics.median(runs) for name, runs in throughputs.items()}
    best = max(medians.values())
    ratios = {name: median / best for name, median in medians.items()}
    spreads = {name: (max(runs) - min(runs)) / medians[name] for name, runs in throughputs.items()}
    return {
        "medians": medians,
        "ratios": ratios,
        "lowest": min(ratios.values()),
        "median_ratio": statistics.median(ratios.values()),
        "at_target": sum(r >= target for r in ratios.values()) / len(ratios),
        "target": target,
        "spreads": spreads,
    }


def run_noise(
    names: list[str], sizes: wl.Sizes, twins: int, repeat: int, num_workers: int
) -> dict[str, Any]:
    """Measure ``twins`` twins of one configuration on each of ``names``, ``repeat`` rounds, each
    in a fresh process as ``bench/run.py`` measures its rows, and return the report (the JSON
    document)."""
    with pristine_parent():
        return _run_noise(names, sizes, twins, repeat, num_workers)


def _run_noise(
    names: list[str], sizes: wl.Sizes, twins: int, repeat: int, num_workers: int
) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(quick=True), "workloads": {}}
    report["machine"]["run"].update(repeat=repeat, twins=twins, num_workers=num_workers)
    for name in names:
        work = suite.WORKLOADS[name](sizes, True)
        print(
            f"\n{name}: {twins} twins of DataLoader(num_workers={num_workers}), {repeat} rounds",
            flush=True,
        )
        rounds = run_rounds(
            partial(twin_trials, work, sizes, twins, num_workers), repeat, on_run=_print_run
        )
        throughputs = {
            key: [run["throughput"] for run in runs] for key, runs in rounds.runs.items()
        }
        report["workloads"][name] = {"unit": work.unit, "runs": throughputs, **floor(throughputs)}
    return report


def _print_run(k: int, trial: Trial, result: dict[str, Any]) -> None:
    print(f"  round {k + 1} {trial.key}: {result['throughput']:.4g}", flush=True)


def format_floor(report: dict[str, Any]) -> str:
    lines = ["workload  twins  lowest  median  at >= target  widest spread"]
    for name, entry in report["workloads"].items():
        lines.append(
            f"{name:9s} {len(entry['ratios']):5d}  {entry['lowest']:.2f}    {entry['median_ratio']:.2f}    "
            f"{entry['at_target']:.0%} (>= {entry['target']})  {max(entry['spreads'].values()):.0%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    known = list(suite.WORKLOADS)
    parser.add_argument(
        "--workloads", default="jpeg,records,tiny", help=f"comma-separated, from {known}"
    )
    parser.add_argument(
        "--twins",
        type=int,
        default=9,
        help="rows of the one configuration (run.py holds zero-knob "
        "rows to the best of 9 that do the same work)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds: each twin is the median of this many runs"
    )
    parser.add_argument(
        "--num-workers", type=int, default=2, help="the DataLoader configuration twinned"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in suite.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(suite.WORKLOADS)}")
    if args.twins < 2 or args.repeat < 1 or args.num_workers < 0:
        parser.error("--twins must be at least 2, --repeat at least 1, --num-workers at least 0")
    start = time.perf_counter()
    report = run_noise(names, wl.QUICK, args.twins, args.repeat, args.num_workers)
    report["machine"]["run"]["seconds"] = round(time.perf_counter() - start, 1)
    print()
    print(format_floor(report))
    write_report(report, args.json)


if __name__ == "__main__":
    main()

"""Configurations measured in rounds (``bench/run.py --repeat N``): each once a round, A B C A B C.

A workload's configurations are :class:`Trial` s. A round measures every trial once, in order;
``N`` rounds measure each ``N`` times, alternating, so a slow spell of a shared machine falls on
every configuration alike rather than on whichever ran then (issue #42). Each configuration is
then reported as the median of its runs (:func:`summarize`): every number in it is a median
(each epoch's rate on its own, for an epochs workload), its ``spread`` is ``(max - min) /
median`` of the throughputs, and ``runs`` keeps every run's values. Every ratio and target
verdict computed from those results is a ratio of medians. A grid's best (``dataloader_best``,
``torchpipe_best``, ``<library>_best``) is the grid point with the highest median throughput
(:func:`best_of`).

Each measurement runs in a fresh process forked from this one (``bench/isolate.py``), so no row's
heap or worker pools reach the next; trials that share state from one measurement to the next (a
cache's epochs: ``together``) share one process. A trial that fails is recorded (``Rounds.failed``)
and the round goes on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.isolate import TIMEOUT_S, in_fresh_process

MEDIAN_KEYS = (
    "throughput",
    "steady_throughput",
    "first_batch_s",
    "converge_s",
    "peak_rss_mb",
    "peak_held_mb",
    "start_held_mb",
    "peak_growth_mb",
    "peak_pss_mb",
    "end_pss_mb",
    "end_held_mb",
    "cpu_s_per_item",
    "others_cpu_share",
    "sampler_cpu_share",
    "row_wall_s",
    "measure_s",
)
"""The numbers of a result that are reported as their median over the runs."""


@dataclass
class Trial:
    """One configuration (or grid point), measured once a round.

    Attributes:
        key: unique within the workload: its runs are filed under it from round to round.
        measure: makes one measurement and returns its result (``bench/measure.py``'s dict).
        name: the configuration it is reported as on its own (None: a grid point only).
        best_of: the ``<x>_best`` it competes for (None: none).
        knobs: its settings, as the report's ``chosen`` shows them when it is a best.
        group: trials that fail together (a peer library): after one raises, the others of the
            group are skipped, and none of the group's results is reported.
        together: trials of a round with the same value, one after another, are measured in one
            fresh process (a cache filled by the first and replayed by the next); None: alone.
    """

    key: str
    measure: Callable[[], dict[str, Any]]
    name: str | None = None
    best_of: str | None = None
    knobs: Any = None
    group: str | None = None
    together: str | None = None


@dataclass
class Rounds:
    """What :func:`run_rounds` measured: every trial's runs, and the groups that failed (why)."""

    trials: dict[str, Trial] = field(default_factory=dict)
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    failed: dict[str, list[str]] = field(default_factory=dict)
    """The trials without a group that failed: each failure, ``"round k: <error>"`` (their other
    rounds' runs are kept)."""


def run_rounds(
    plan: Callable[[], list[Trial]],
    repeat: int,
    on_run: Callable[[int, Trial, dict[str, Any]], None] = lambda k, trial, result: None,
    on_error: Callable[[Trial, BaseException], None] = lambda trial, error: None,
    fresh: bool = True,
    timeout_s: float = TIMEOUT_S,
) -> Rounds:
    """Measure ``plan()``'s trials ``repeat`` times, each once a round, in ``plan()``'s order.

    ``plan`` is called afresh each round, so a trial whose pipeline holds state from one
    measurement to the next (a cache filled by one and replayed by the next) starts each round
    anew. Each trial (or run of trials ``together``) is measured in a fresh process where
    ``fresh`` (``bench/isolate.py``), else in this one. Each result gains ``measure_s`` (the
    measurement's own seconds) and ``row_wall_s`` (its share of the fresh process's wall time:
    the difference is what the fresh process cost). ``on_run(round, trial, result)`` is called
    after each measurement. A trial that raises is handed to ``on_error``: one with a ``group``
    drops the group (its runs are forgotten, its later trials skipped); one without is recorded
    in ``failed`` and the others go on; so does one that runs past ``timeout_s`` (each trial of a
    batch measured together has that long), which is killed after its threads' stacks are taken.

    Raises:
        ValueError: if ``repeat`` is below 1, or a round's trials have duplicate keys.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    done = Rounds()
    for k in range(repeat):
        trials = plan()
        keys = [trial.key for trial in trials]
        if len(set(keys)) != len(keys):
            raise ValueError(f"round {k}: duplicate trial keys in {keys}")
        for batch in _together(trials):
            batch = [
                trial for trial in batch if trial.group is None or trial.group not in done.errors
            ]
            if not batch:
                continue
            try:
                results = _measured(batch, fresh, timeout_s)
            except Exception as e:  # noqa: BLE001 - one row's failure is recorded, the run goes on
                _failed(done, k, batch, e, on_error)
                continue
            for trial, result in zip(batch, results):
                done.trials[trial.key] = trial
                done.runs.setdefault(trial.key, []).append(result)
                on_run(k, trial, result)
    for key in [key for key, trial in done.trials.items() if trial.group in done.errors]:
        del done.trials[key], done.runs[key]
    return done


def _together(trials: list[Trial]) -> Iterator[list[Trial]]:
    """``trials`` in runs measured in one process: consecutive trials with the same ``together``."""
    batch: list[Trial] = []
    for trial in trials:
        if batch and (trial.together is None or trial.together != batch[-1].together):
            yield batch
            batch = []
        batch.append(trial)
    if batch:
        yield batch


def _measured(
    batch: list[Trial], fresh: bool, timeout_s: float = TIMEOUT_S
) -> list[dict[str, Any]]:
    """Each trial of ``batch`` measured, one after another, in one fresh process (``fresh``: within
    ``timeout_s`` a trial) or here."""
    measures = [_clocked(trial.measure) for trial in batch]
    if fresh:
        results, wall = in_fresh_process(measures, timeout_s * len(measures))
    else:
        start = time.perf_counter()
        results = [measure() for measure in measures]
        wall = time.perf_counter() - start
    for result in results:
        result["row_wall_s"] = wall / len(results)
    return results


def _clocked(measure: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        start = time.perf_counter()
        result = dict(measure())
        result["measure_s"] = time.perf_counter() - start
        return result

    return run


def _failed(
    done: Rounds,
    k: int,
    batch: list[Trial],
    error: Exception,
    on_error: Callable[[Trial, BaseException], None],
) -> None:
    """Record ``error`` for every trial of ``batch`` (measured together, they failed together)."""
    message = f"{type(error).__name__}: {error}"
    for trial in batch:
        if trial.group is not None:
            done.errors.setdefault(trial.group, message)
        else:
            done.failed.setdefault(trial.key, []).append(f"round {k}: {message}")
        on_error(trial, error)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs as one result: each number the median of its runs.

    ``epoch_rates`` is the median of each epoch's rate; what is not a number (``where``,
    ``placement``, ``epoch_executors``) is the median run's (the run whose throughput ranks in
    the middle, the lower of the two middle ones for an even count). A number some run could
    not measure (None: PSS without ``/proc``) is the median of those that did, or None.
    ``spread`` is ``(max - min) / median`` of the throughputs (0 for one run); ``runs`` every run.

    Raises:
        ValueError: for no runs.
    """
    if not runs:
        raise ValueError("no runs to summarize")
    ranked = sorted(runs, key=lambda r: r["throughput"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    for key in MEDIAN_KEYS:
        if key in out:
            values = [r[key] for r in runs if r.get(key) is not None]
            out[key] = statistics.median(values) if values else None
    if "epoch_rates" in out:
        out["epoch_rates"] = [
            statistics.median(rates) for rates in zip(*(r["epoch_rates"] for r in runs))
        ]
    rates = [r["throughput"] for r in runs]
    out["spread"] = (max(rates) - min(rates)) / out["throughput"] if out["throughput"] else None
    out["runs"] = [{k: v for k, v in r.items() if k not in ("runs", "spread")} for r in runs]
    return out


def best_of(done: Rounds, group: str) -> tuple[Trial, dict[str, Any]] | None:
    """The trial competing for ``group`` with the highest median throughput, and its summary
    (None where none was measured)."""
    summaries = [
        (trial, summarize(done.runs[key]))
        for key, trial in done.trials.items()
        if trial.best_of == group
    ]
    return max(summaries, key=lambda pair: pair[1]["throughput"], default=None)


def report(done: Rounds) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The results by configuration (each named trial's summary, and each group's best) and the
    knobs each best was chosen with."""
    results = {
        trial.name: summarize(done.runs[key]) for key, trial in done.trials.items() if trial.name
    }
    chosen = {}
    for group in dict.fromkeys(trial.best_of for trial in done.trials.values() if trial.best_of):
        found = best_of(done, group)
        if found is not None:
            results[group], chosen[group] = found[1], found[0].knobs
    return results, chosen

"""``iterator.stats()``: per-stage numbers of a running pass, printable as a one-call report.

The report names the bottleneck (from the model of the tuner's latest window when it runs, else
of the whole pass) and says whether the training loop or the pipeline is the limit.
"""

from __future__ import annotations

import os
from typing import Any

from torchpipe.autotune import tunable
from torchpipe.autotune.autotuner import Decision
from torchpipe.autotune.live import (
    CONSUMER,
    Look,
    build_model,
    caller_seconds,
    look,
    walk_iterators,
)
from torchpipe.autotune.model import bottleneck
from torchpipe.autotune.tunable import POOL
from torchpipe.core.iterator import Iterator
from torchpipe.observe.tracing import TraceSnapshot
from torchpipe.runtime.counts import COUNTS

WAITING_LIMIT = 0.2
"""A training loop that waits for data more than this share of its time is fed too slowly."""


class PipelineStats(list):
    """The stages' stats, root first, each a dict; ``print()`` it for the report.

    Each dict has ``stage`` (its name), ``depth`` (0 for the root), ``produced``, ``throughput``
    (elements/s over the pass), ``self_s`` (seconds of its own work per element, on whatever thread
    or worker ran it), and where they apply ``wait_ratio`` (share of its consumer's time in
    ``next()`` spent waiting on it), ``occupancy`` (mean fill of its buffer / its capacity),
    ``knobs`` (AUTOTUNE values now), the op's own counters (``errors_ignored``,
    ``inner_datasets``) and, for a stage that runs work off the consumer's thread (a parallel map
    or interleave, a prefetch, the DataLoader's workers), where it runs: ``executor``
    (``inline``, ``thread``, ``process`` or ``ray``), ``workers`` (threads, processes or actors;
    ``threads_per_worker`` where processes run several reads at once) and ``pids`` (its worker
    processes, to attach a profiler to); a ``num_workers="auto"`` DataLoader adds ``measured``
    (the executors it has measured lately) and, where its dataset draws from the global RNGs,
    ``not_on_threads`` (why it never makes batches on threads).

    Attributes:
        seconds: since the pass started.
        bottleneck: the stage that limits the pipeline, or ``"consumer"``.
        waiting: the share of the training loop's time spent waiting for data.
        decisions: the autotuner's recent rounds (empty without one).
        images: ``tp.image``'s counts since the pass started, in this process and the processes
            forked from it: ``decoded`` (images decoded) and ``fallback`` (those Pillow decoded
            because the fast decoder refused them).
    """

    def __init__(
        self,
        stages: list[dict[str, Any]],
        seconds: float,
        bottleneck: str,
        waiting: float,
        decisions: list[Decision],
        trace: TraceSnapshot | None = None,
        images: dict[str, int] | None = None,
    ) -> None:
        super().__init__(stages)
        self.images = images if images is not None else {"decoded": 0, "fallback": 0}
        self.seconds = seconds
        self.bottleneck = bottleneck
        self.waiting = waiting
        self.decisions = decisions
        self.trace = trace

    def plot(self, path: str | os.PathLike) -> None:
        """Draw the pass's timeline to a PNG: a row per stage and per thread or worker process,
        a bar for each element produced or call run, the training loop's waits for data in red,
        buffer occupancy and knob values below (needs ``pip install 'torchpipe[plot]'``).

        Raises:
            RuntimeError: if the pass was not traced (``tp.Options(trace=True)``).
            ImportError: if matplotlib is missing, naming the extra that installs it.
        """
        from torchpipe.observe.timeline import plot_timeline

        if self.trace is None:
            raise RuntimeError(
                "this pass is not traced: run it with ds.with_options(tp.Options(trace=True)) to plot "
                "its timeline"
            )
        plot_timeline(
            self.trace,
            path,
            title=f"torchpipe pass: {self.seconds:.2f} s, bottleneck {self.bottleneck}",
        )

    @property
    def consumer_is_limit(self) -> bool:
        """Whether the training loop, not the pipeline, sets the pace."""
        return self.bottleneck == CONSUMER or self.waiting < WAITING_LIMIT

    def __str__(self) -> str:
        return self.report()

    def report(self) -> str:
        """The text report."""
        if not self:
            return "torchpipe: the pass has not started"
        root = self[0]
        lines = [
            f"torchpipe pass: {self.seconds:.1f} s, {root['produced']} elements, {root['throughput']:.4g}/s",
            f"{'stage':<36} {'elements':>9} {'per s':>9} {'self/elem':>10} {'wait':>5} {'buffer':>7}  knobs",
        ]
        lines.extend(_stage_line(stage) for stage in self)
        lines.extend(
            line
            for stage in self
            if "ray" in stage
            for line in _ray_lines(stage["stage"], stage["ray"])
        )
        lines.extend(self._verdict_lines())
        return "\n".join(lines)

    def _verdict_lines(self) -> list[str]:
        """What the numbers say: images decoded, the bottleneck, the limit, the tuner's choice."""
        lines = []
        if self.images["decoded"]:
            lines.append(
                f"Images: {self.images['decoded']} decoded by tp.image, {self.images['fallback']} of them by "
                "Pillow (the fast decoder refused them)"
            )
        lines.append(f"Bottleneck: {self.bottleneck}")
        if self.consumer_is_limit:
            lines.append(
                f"Limit: the consumer (training step); it waited for data {self.waiting:.0%} of its time."
            )
        else:
            lines.append(
                f"Limit: the pipeline; the consumer waited for data {self.waiting:.0%} of its time."
            )
        if self.decisions:
            last = self.decisions[-1]
            chosen = ", ".join(f"{k}={v}" for k, v in last.values.items())
            lines.append(
                f"Autotune: {len(self.decisions)} rounds; now {chosen} (measured {last.throughput:.4g}/s, "
                f"model predicts {last.predicted:.4g}/s)"
            )
        return lines


def _stage_line(stage: dict[str, Any]) -> str:
    """A stage's row of the report's table."""
    wait = f"{stage['wait_ratio']:.0%}" if "wait_ratio" in stage else ""
    fill = f"{stage['occupancy']:.0%}" if "occupancy" in stage else ""
    knobs = ", ".join(f"{k}={v}" for k, v in stage.get("knobs", {}).items())
    name = "  " * stage["depth"] + stage["stage"]
    return (
        f"{name[:36]:<36} {stage['produced']:>9} {stage['throughput']:>9.4g} "
        f"{_duration(stage['self_s']):>10} {wait:>5} {fill:>7}  {knobs}"
    )


def _ray_lines(stage: str, ray: dict[str, Any]) -> list[str]:
    """A stage's Ray actors: their calls, and what receiving results cost this process."""
    rate = ray["transfer_bytes_per_s"] / 1e6
    lines = [
        f"{stage} on Ray: {len(ray['actors'])} actors, {ray['results']} results, "
        f"{_duration(ray['transfer_s'])} a result to fetch and decode ({rate:.4g} MB/s)"
    ]
    for name, actor in ray["actors"].items():
        restarts = f", {actor['restarts']} restarts" if actor["restarts"] else ""
        lines.append(
            f"  {name}: {actor['calls']} calls, {_duration(actor['call_s'])} a call{restarts}"
        )
    return lines


def _duration(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def pipeline_stats(
    root: Iterator,
    start: Look,
    consumer_s: float,
    decisions: list[Decision],
    trace: TraceSnapshot | None = None,
) -> PipelineStats:
    """The stats of the pass under ``root``; ``start`` is :func:`~torchpipe.autotune.live.start_look` of
    when its tree was built; ``trace`` the pass's events if it is traced."""
    now = look(root, consumer_s)
    seconds = max(now.time - start.time, 1e-9)
    # the tree is built when the pass starts: totals are the pass's
    stages = [_stage_entry(it, depth, now, seconds) for it, depth in walk_iterators(root)]
    if decisions:
        limit = decisions[-1].bottleneck
    else:
        model = build_model(root, start, now)
        limit = bottleneck(model.stages, {knob.name: knob.value for knob in model.knobs})
    inside = now.iterators[id(root)].wall_s
    waiting = inside / (inside + consumer_s) if inside + consumer_s > 0 else 0.0
    counts = COUNTS.snapshot()
    images = {
        "decoded": counts["images_decoded"] - start.shared.get("images_decoded", 0),
        "fallback": counts["images_fallback"] - start.shared.get("images_fallback", 0),
    }
    return PipelineStats(stages, seconds, limit, waiting, list(decisions), trace, images)


def _stage_entry(it: Iterator, depth: int, now: Look, seconds: float) -> dict[str, Any]:
    """The stats of one stage, ``depth`` below the root, over the pass's ``seconds``."""
    counters = now.iterators[id(it)]
    entry: dict[str, Any] = {
        "stage": it.name,
        "depth": depth,
        "produced": counters.produced,
        "throughput": counters.produced / seconds,
    }
    if tunable.role(it) == POOL:  # its calls' own time, on the threads or workers that ran them
        entry["self_s"] = counters.work_s / max(counters.calls, 1)
    else:
        inputs_wall = sum(now.iterators[id(child)].wall_s for child in it.children())
        entry["self_s"] = caller_seconds(it, counters, inputs_wall) / max(counters.produced, 1)
    if counters.wall_s > 0 and tunable.role(it) is not None:
        entry["wait_ratio"] = counters.wait_s / counters.wall_s
    if it.stats.occupancy_n:
        entry["occupancy"] = (
            it.stats.occupancy_sum / it.stats.occupancy_n / max(it.stats.capacity, 1)
        )
    if tunable.knobs(it):
        entry["knobs"] = {knob.name: knob.value for knob in tunable.knobs(it)}
    entry.update(it.stats.counters)  # errors_ignored, inner_datasets, ...
    # where its calls run: executor, workers, pids
    entry.update(getattr(it, "executor_report", dict)())
    return entry

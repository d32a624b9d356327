"""The autotuner's own benchmarks: adaptation, the RAM budget, and the cost of the stats.

  adaptation   a map whose function waits 1 ms, then 5 ms from halfway on (storage got slower):
               prints the parallelism the tuner chose over time and how long it took to raise it
  ram          4 MB elements through prefetch(AUTOTUNE) with a 20 MB budget: the deepest buffer
               the tuner chose, against the budget
  overhead     the tiny workload's per-element pipeline with the stats every iterator keeps, and
               with their clock reads patched out: the overhead (median of alternating pairs)

Run: python bench/autotune.py [--only adaptation,ram,overhead]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench.workloads import tiny
from torchpipe.core import iterator as base


class Storage:
    """A read that waits ``slow_s`` once ``switch_at`` seconds have passed, ``fast_s`` before."""

    def __init__(self, fast_s: float, slow_s: float, switch_at: float) -> None:
        self.fast_s, self.slow_s, self.switch_at = fast_s, slow_s, switch_at
        self.start = time.monotonic()

    def __call__(self, i: int) -> torch.Tensor:
        slow = time.monotonic() - self.start >= self.switch_at
        time.sleep(self.slow_s if slow else self.fast_s)
        return torch.full((16,), float(i))


def adaptation(seconds: float = 16.0) -> dict[str, float]:
    """The function becomes 5x slower halfway through; when does the parallelism follow?"""
    half = seconds / 2
    read = Storage(0.001, 0.005, half)
    ds = (
        tp.range(10**9)
        .map(read, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .batch(16)
        .prefetch(tp.AUTOTUNE)
    )
    it = iter(ds)
    knob = "map(Storage)+batch.parallelism"
    timeline, start, raised_at, before = [], time.monotonic(), None, None
    count, marks = 0, [(start, 0)]
    while (now := time.monotonic()) - start < seconds:
        next(it)
        count += 16
        value = it.tuned_values().get(knob)
        if not timeline or timeline[-1][1] != value:
            timeline.append((now - start, value))
        if now - start < half:
            before = value
        elif raised_at is None and value is not None and before is not None and value > before:
            raised_at = now - start - half
        if now - marks[-1][0] >= 1.0:
            marks.append((now, count))
    it.close()
    print("parallelism over time (s: value): " + ", ".join(f"{t:.1f}: {v}" for t, v in timeline))
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
    print("items/s each second: " + ", ".join(f"{r:.0f}" for r in rates))
    if raised_at is None:
        print(f"the tuner did not raise the parallelism after the slowdown at {half:.0f} s")
        return {"raised_after_s": float("nan"), "before": before or 0}
    print(
        f"parallelism {before} before the slowdown; raised {raised_at:.2f} s after it, to {timeline[-1][1]}"
    )
    return {"raised_after_s": raised_at, "before": before or 0, "after": timeline[-1][1]}


def _big(i: int) -> torch.Tensor:
    time.sleep(0.004)
    return torch.full((1 << 20,), float(i))  # 4 MB


def ram(seconds: float = 6.0) -> dict[str, float]:
    """The deepest prefetch buffer the tuner chose for 4 MB elements, with and without a budget."""
    out = {}
    for budget in (20 << 20, None):
        options = tp.Options(autotune=tp.AutotuneOptions(ram_budget=budget))
        it = iter(tp.range(10**9).map(_big).prefetch(tp.AUTOTUNE).with_options(options))
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            next(it)
            time.sleep(0.004)  # a training step as long as the producer's: a deeper buffer pays
        deepest = max((d.values["prefetch.buffer_size"] for d in it.decisions()), default=0)
        it.close()
        label = "no budget" if budget is None else f"budget {budget >> 20} MB"
        print(f"{label}: deepest buffer {deepest} x 4 MB = {deepest * 4} MB")
        out["deepest_mb" if budget else "deepest_mb_unbounded"] = deepest * 4.0
    return out


def _untimed_next(self: base.Iterator) -> object:
    if self._status != base._RUNNING:
        self._begin()
    element = self.next()
    self.stats.produced += 1
    return element


def overhead(elements: int = 100_000, rounds: int = 12) -> dict[str, float]:
    """Elements/s of ``tiny``'s per-element pipeline with and without the stats' clock reads.

    The two run alternately (ABBA), ``rounds`` pairs; the overhead is the median of the pairs'
    time ratios (a pair runs seconds apart, so the machine's drift mostly cancels).
    """
    timed_next = base.Iterator.__next__
    ds = (
        tp.range(elements)
        .map(tiny)
        .batch(256)
        .with_options(tp.Options(optimizations={"inject_prefetch": False}))
    )
    ratios, rates = [], {"with stats": [], "without": []}
    arms = [("with stats", timed_next), ("without", _untimed_next)]
    for round_ in range(rounds):
        seconds = {}
        for label, method in arms if round_ % 2 else arms[::-1]:  # ABBA: neither always goes first
            base.Iterator.__next__ = method
            try:
                t0 = time.perf_counter()
                for _ in ds:
                    pass
                seconds[label] = time.perf_counter() - t0
            finally:
                base.Iterator.__next__ = timed_next
            rates[label].append(elements / seconds[label])
        ratios.append(seconds["with stats"] / seconds["without"] - 1.0)
    cost = statistics.median(ratios)
    print(
        f"tiny, inline: {statistics.median(rates['with stats']):.0f} elem/s with stats, "
        f"{statistics.median(rates['without']):.0f} without: overhead {cost:.1%} "
        f"(median of {rounds} alternating pairs)"
    )
    # The same from the cost of one call (steadier than whole runs on a noisy machine).
    it = iter(ds)
    for _ in it:
        pass
    calls = sum(stage["produced"] for stage in it.stats()) / elements
    delta = _call_ns(timed_next) - _call_ns(_untimed_next)
    per_element = 1e9 / statistics.median(rates["without"])
    print(
        f"per call: the clocks add {delta:.0f} ns; {calls:.2f} calls per element of {per_element:.0f} ns: "
        f"overhead {delta * calls / per_element:.2%}"
    )
    return {"overhead": cost, "overhead_from_calls": delta * calls / per_element}


class _One(base.Iterator):
    def next(self) -> int:
        return 1

    def get_state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass


def _call_ns(method: object, calls: int = 1_000_000) -> float:
    """Nanoseconds per ``next()`` of a trivial iterator with ``method`` as ``Iterator.__next__``
    (best of three)."""
    timed_next, it, best = base.Iterator.__next__, _One("one"), math.inf
    base.Iterator.__next__ = method
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                next(it)
            best = min(best, (time.perf_counter() - t0) / calls * 1e9)
    finally:
        base.Iterator.__next__ = timed_next
    return best


BENCHES = {"adaptation": adaptation, "ram": ram, "overhead": overhead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(BENCHES), help=f"comma-separated, from {list(BENCHES)}"
    )
    args = parser.parse_args()
    for name in args.only.split(","):
        print(f"\n{name}:", flush=True)
        BENCHES[name.strip()]()


if __name__ == "__main__":
    main()

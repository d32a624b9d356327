"""The cost of tracing on the ``tiny`` workload, where per-element overhead is all there is.

Two pipelines over ``tiny`` (an int to a 4-float tensor, batch 256): ``inline``, the per-element
pipeline ``tp.range(n).map(tiny).batch(256)`` on one thread (every hook runs on the consumer's
thread: the worst case), and ``auto``, the bench's zero-knob configuration
``tp.from_dataset(range(n)).map(tiny, tp.AUTOTUNE).batch(256)`` (a prefetch injected, pools and
tuner as they choose). Each is run in four arms:

  untraced code   ``Iterator.__next__`` as it was before tracing existed (no hook at all)
  trace off       as shipped, ``Options(trace=False)``, the default
  trace on        ``Options(trace=True)``
  trace all       ``Options(trace="all")``

Every round runs each arm once, in a rotated order (the machine drifts); an arm's overhead is the
median over rounds of its time over the untraced code's in the same round.

Run: python bench/tracing.py [--elements N] [--rounds R] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench.workloads import tiny
from torchpipe.core import iterator as base

ARMS = ("untraced code", "trace off", "trace on", "trace all")


def _untraced_next(self: base.Iterator) -> object:
    """``Iterator.__next__`` before tracing: the same clocks, no trace hook."""
    if self._status != base._RUNNING:
        self._begin()
    stats = self.stats
    if stats.unclocked:
        stats.unclocked -= 1
        element = self.next()
        stats.produced += 1
        return element
    t0, waited = time.perf_counter(), stats.wait_s
    element = self.next()
    stats.produced += 1
    stats.clocked(time.perf_counter() - t0, stats.wait_s - waited)
    return element


PIPELINES: dict[str, Callable[[int], tp.Dataset]] = {
    "inline": lambda n: (
        tp.range(n)
        .map(tiny)
        .batch(256)
        .with_options(tp.Options(optimizations={"inject_prefetch": False}))
    ),
    "auto": lambda n: tp.from_dataset(range(n)).map(tiny, tp.AUTOTUNE).batch(256),
}


def _run(ds: tp.Dataset, arm: str) -> float:
    options = {"untraced code": False, "trace off": False, "trace on": True, "trace all": "all"}[
        arm
    ]
    shipped = base.Iterator.__next__
    if arm == "untraced code":
        base.Iterator.__next__ = _untraced_next
    try:
        t0 = time.perf_counter()
        for _ in ds.with_options(tp.Options(trace=options)):
            pass
        return time.perf_counter() - t0
    finally:
        base.Iterator.__next__ = shipped


def measure(name: str, elements: int, rounds: int) -> dict[str, Any]:
    ds = PIPELINES[name](elements)
    _run(ds, "trace off")  # warm-up: imports, the executor choice, zygotes
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(rounds):
        order = ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]
        for arm in order:
            seconds[arm].append(_run(ds, arm))
    base_s = seconds["untraced code"]
    result = {
        "elements": elements,
        "rounds": rounds,
        "elements_per_s": {arm: elements / statistics.median(s) for arm, s in seconds.items()},
        "overhead": {
            arm: statistics.median(a / b - 1.0 for a, b in zip(s, base_s))
            for arm, s in seconds.items()
            if arm != "untraced code"
        },
    }
    rates = ", ".join(f"{arm} {rate:,.0f}/s" for arm, rate in result["elements_per_s"].items())
    costs = ", ".join(f"{arm} {cost:+.1%}" for arm, cost in result["overhead"].items())
    print(
        f"tiny {name}: {rates}\n  overhead against the untraced code (median of {rounds} rounds): {costs}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elements", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pipelines", default="inline,auto")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {
        name: measure(name, args.elements, args.rounds) for name in args.pipelines.split(",")
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""What executor="ray" costs against executor="process", on one machine.

On one machine a local Ray cluster cannot be faster than worker processes (the same cores, plus
Ray's own daemons); this measures what it costs instead, side by side in one run, on two of the
bench's workloads (bench/workloads.py):

  jpeg       decode a ~320 px JPEG, random 224 crop and flip (CPU-bound; ~150 KB a result)
  bigtensor  a 3x224x224 float32 fill (IPC-bound: 602 KB a result, almost no work)

each in two arms: ``batch``, the map fused with ``batch(64)`` (one call and one object per batch:
how a pipeline should run on Ray), and ``element``, one call and one object per element (the
per-call cost laid bare). Every arm runs on ``process`` and on ``ray`` with the same number of
workers (the usable cores), in rotated order over the rounds; a rate is the median over rounds.

Reported per arm: elements/s on each and their ratio; the extra seconds per element on Ray
(1/rate_ray - 1/rate_process); this process's CPU per element on each (what feeding the
consumer costs the trainer's host: submitting, receiving, decoding); MB/s of results through
Ray's object store as the pool measured fetching and decoding them, and end to end.

Run: python bench/ray_overhead.py [--seconds S] [--rounds R] [--json out.json]
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
from bench import data
from bench.workloads import JpegSample, big_tensor
from torchpipe.runtime.cpu import usable_cpu_count

EXECUTORS = ("process", "ray")
BATCH = 64


def _pipelines(jpeg_files: int) -> dict[str, Callable[[str, int], tp.Dataset]]:
    jpeg = JpegSample(data.jpeg_files(jpeg_files))
    length = 10**7

    def make(fn: Callable[[int], Any], batched: bool) -> Callable[[str, int], tp.Dataset]:
        def build(executor: str, workers: int) -> tp.Dataset:
            ds = tp.from_dataset(range(length)).map(fn, workers, executor=executor)
            return ds.batch(BATCH) if batched else ds

        return build

    return {
        "jpeg batch": make(jpeg, True),
        "jpeg element": make(jpeg, False),
        "bigtensor batch": make(big_tensor, True),
        "bigtensor element": make(big_tensor, False),
    }


def _size(element: Any) -> tuple[int, int]:
    """(elements, bytes of tensors) in a result: a batch or one element."""
    tensors = element if isinstance(element, tuple) else (element,)
    first = tensors[0]
    count = int(first.shape[0]) if first.dim() == 4 else 1
    return count, sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))


def _run(ds: tp.Dataset, warmup_s: float, seconds: float) -> dict[str, Any]:
    """Consume ``ds`` for ``warmup_s``, then measure for ``seconds``."""
    it = iter(ds)
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        next(it)
    elements = nbytes = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        count, size = _size(next(it))
        elements += count
        nbytes += size
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ray = next((stage["ray"] for stage in it.stats() if "ray" in stage), None)
    it.close()
    result = {
        "elements_per_s": elements / wall,
        "bytes_per_s": nbytes / wall,
        "main_cpu_s": cpu / elements,
    }
    if ray is not None:
        result["store_bytes_per_s"] = ray["transfer_bytes_per_s"]
        result["fetch_decode_s"] = ray["transfer_s"]
    return result


def measure(
    name: str, build: Callable[[str, int], tp.Dataset], workers: int, rounds: int, seconds: float
) -> dict:
    runs: dict[str, list[dict[str, Any]]] = {executor: [] for executor in EXECUTORS}
    for round_ in range(rounds):
        for executor in EXECUTORS[round_ % 2 :] + EXECUTORS[: round_ % 2]:
            runs[executor].append(_run(build(executor, workers), 0.5 if round_ else 2.0, seconds))
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
    proc, ray = med["process"], med["ray"]
    result = {
        "workers": workers,
        "process": proc,
        "ray": ray,
        "ray_over_process": ray["elements_per_s"] / proc["elements_per_s"],
        "extra_s_per_element": 1 / ray["elements_per_s"] - 1 / proc["elements_per_s"],
    }
    print(
        f"{name:<17} process {proc['elements_per_s']:8.0f}/s  ray {ray['elements_per_s']:8.0f}/s  "
        f"ray/process {result['ray_over_process']:.2f}x  extra {result['extra_s_per_element'] * 1e6:7.0f} us/elem  "
        f"main CPU {proc['main_cpu_s'] * 1e6:5.0f} vs {ray['main_cpu_s'] * 1e6:5.0f} us/elem  "
        f"store {ray['store_bytes_per_s'] / 1e6:6.0f} MB/s (fetch+decode {ray['fetch_decode_s'] * 1e6:.0f} us "
        f"a result), end to end {ray['bytes_per_s'] / 1e6:5.0f} MB/s (process {proc['bytes_per_s'] / 1e6:5.0f})"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jpeg-files", type=int, default=512)
    parser.add_argument(
        "--arms", default="jpeg batch,jpeg element,bigtensor batch,bigtensor element"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    import ray

    cores = usable_cpu_count()
    ray.init(num_cpus=cores, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    print(
        f"{cores} usable cores; Ray {ray.__version__}, a local cluster of {cores} CPUs; "
        f"{args.rounds} rounds of {args.seconds} s per arm and executor"
    )
    pipelines = _pipelines(args.jpeg_files)
    results = {
        arm: measure(arm, pipelines[arm], cores, args.rounds, args.seconds)
        for arm in args.arms.split(",")
    }
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

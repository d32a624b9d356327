"""Each static pass on against off, side by side, on a pipeline where it applies.

Every case runs with all passes on, and with all passes on except the one under test; the
two alternate (on, off, on, off, ...) and the best of each is kept, so a noisy neighbour
hurts both alike. Units are elements (or payload bytes) per second in the consumer.

Run: python bench/optimizer.py [--seconds 1.0] [--rounds 2] [--cases map_fusion,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench import data
from bench.measure import measure
from bench.workloads import tiny

STEP_S = 0.002  # the simulated training step of the inject_prefetch case
BIG = 256 << 10  # bytes per element in the transfer-bound cases


class Blobs(torch.utils.data.Dataset):
    """Element ``i``: a fresh 256 KB float tensor (building it is the fetch's whole cost)."""

    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((BIG // 4,), float(i))


def inc(x: int) -> int:
    return x + 1


def odd(x: int) -> bool:
    return x % 2 == 1


def not_div3(x: int) -> bool:
    return x % 3 != 0


def keep_quarter(x: torch.Tensor) -> bool:
    return int(x[0]) % 4 == 0


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 + 1.0


def python_work(x: int) -> int:
    total = 0
    for k in range(2000):
        total += (x ^ k) & 7
    return total


def light(x: torch.Tensor) -> torch.Tensor:
    return x


def busy(x: int) -> int:
    end = time.perf_counter() + STEP_S / 2
    while time.perf_counter() < end:
        pass
    return x


def record_files() -> list[str]:
    """4 TFRecord files of 20,000 records of 1 KB each (made once, in the bench's cache)."""

    def write(directory: Any) -> None:
        for k in range(4):
            with tp.io.TFRecordWriter(directory / f"part-{k}.tfrecord") as writer:
                for i in range(20_000):
                    writer.write(i.to_bytes(4, "little") * 256)

    root = data._materialize("records-1k-v1", write)
    return [str(root / f"part-{k}.tfrecord") for k in range(4)]


def first_word(record: bytes) -> int:
    return int.from_bytes(record[:4], "little")


def records_pipeline() -> tp.Dataset:
    """The seed pipeline's shape on cheap records: files interleaved 4 at a time, a parallel map, batches."""
    files = tp.from_iterable(record_files()).repeat()
    records = files.interleave(tp.TFRecordDataset, cycle_length=4, num_parallel_calls=tp.AUTOTUNE)
    return records.map(first_word, num_parallel_calls=tp.AUTOTUNE).batch(256)


def _items(batch: Any) -> tuple[int, float]:
    n = len(batch) if isinstance(batch, (torch.Tensor, list)) else 1
    return n, float(n)


def _bytes(batch: torch.Tensor) -> tuple[int, float]:
    return int(batch.shape[0]) if batch.dim() > 1 else 1, batch.numel() * batch.element_size() / 1e9


def _with_step(batch: Any) -> tuple[int, float]:
    time.sleep(STEP_S)  # the consumer's own work per batch, e.g. a training step
    return _items(batch)


N = 10**8
CASES: dict[str, tuple[Callable[[], tp.Dataset], Callable[[Any], tuple[int, float]], str]] = {
    "noop_elimination": (
        lambda: tp.range(N).take(-1).skip(0).repeat(1).shard(1, 0).prefetch(0).batch(256),
        _items,
        "elem/s",
    ),
    "shuffle_repeat_fusion": (
        lambda: tp.range(16).shuffle(16).repeat(-1).batch(256),
        _items,
        "elem/s",
    ),
    "vectorize": (
        lambda: (
            tp.from_tensor_slices(torch.randn(200_000, 16))
            .repeat(-1)
            .map(affine, batched=True)
            .batch(256)
        ),
        _items,
        "elem/s",
    ),
    "map_parallelization": (
        lambda: tp.range(N).map(python_work, pure=True).batch(64),
        _items,
        "elem/s",
    ),
    "map_fusion": (
        lambda: tp.range(N).map(inc).map(inc).map(inc).map(inc).batch(256),
        _items,
        "elem/s",
    ),
    "filter_fusion": (
        lambda: tp.range(N).filter(odd).filter(not_div3).filter(odd).batch(256),
        _items,
        "elem/s",
    ),
    "map_filter_fusion": (
        lambda: tp.from_dataset(Blobs()).map(light, 2, executor="process").filter(keep_quarter),
        _bytes,
        "GB/s",
    ),
    "source_pushdown": (
        lambda: tp.from_dataset(Blobs()).map(light, 2, executor="process").batch(16),
        _bytes,
        "GB/s",
    ),
    "record_pushdown": (records_pipeline, _items, "elem/s"),
    "map_batch_fusion": (
        lambda: tp.from_dataset(range(N)).map(tiny, 2, executor="process").batch(256),
        _items,
        "elem/s",
    ),
    "inject_prefetch": (lambda: tp.range(N).map(busy).batch(1), _with_step, "elem/s"),
}


def run_case(name: str, seconds: float, rounds: int) -> dict[str, Any]:
    make, count, unit = CASES[name]
    on: list[float] = []
    off: list[float] = []
    for _ in range(rounds):
        for enabled, out in ((True, on), (False, off)):
            options = tp.Options(optimizations={name: enabled})
            result = measure(
                lambda: make().with_options(options), count, min(0.3, seconds / 3), seconds
            )
            out.append(result["throughput"])
    best_on, best_off = max(on), max(off)
    return {"pass": name, "unit": unit, "on": best_on, "off": best_off, "ratio": best_on / best_off}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    rows = []
    print("| pass | unit | on | off | on / off |\n|---|---|---|---|---|")
    for name in names:
        row = run_case(name, args.seconds, args.rounds)
        rows.append(row)
        print(
            f"| {name} | {row['unit']} | {row['on']:.4g} | {row['off']:.4g} | {row['ratio']:.2f}x |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

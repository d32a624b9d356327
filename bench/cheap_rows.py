"""Where a cheap row's time goes (issue #59): CPU seconds a batch of each loader, and a profile.

Three map-style datasets shaped like ``bench/workloads.py``'s ``records``, ``blobs`` and ``tiny``
(built here, so this script does not follow that module's changes), read by:

- ``plain``: ``default_collate([ds[i] for i in batch])`` over a ``BatchSampler``, the loop a
  user writes;
- ``torch0``: ``torch.utils.data.DataLoader(num_workers=0)``;
- ``tp0``: ``tp.DataLoader(num_workers=0)``;
- ``tp_auto``: ``tp.DataLoader(num_workers="auto")`` (where its policy placed the batches is printed);
- ``dsl``: ``tp.from_dataset(range(n)).map(row, tp.AUTOTUNE, executor="auto").batch(b).prefetch(tp.AUTOTUNE)``,
  as ``bench/run.py`` builds ``torchpipe_auto``;
- ``dsl_ds``: ``tp.from_dataset(ds).batch(b)`` (the dataset read in place; a prefetch injected);
- ``dsl_inline``: the same without the injected prefetch (all on the main thread).

Each is measured in CPU time (``time.thread_time`` of the main thread and ``time.process_time``
of the whole process), which a busy machine's other processes do not inflate: after warm-up
batches, ``--batches`` batches, ``--repeat`` times with a fresh loader; the median is printed.
The components of the plain loop are timed alone the same way: drawing a batch of indices from
the sampler, ``[ds[i] for i in batch]``, and ``default_collate`` of fetched rows.
``--profile`` adds a cProfile of each loader on the main thread (so only ``dsl_inline`` of the DSL
rows shows its work), its time (builtins charged to the
Python function that called them) put in buckets by the module it was spent in.

Run: ``python bench/cheap_rows.py [--workloads records blobs tiny] [--configs ...] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, SequentialSampler, default_collate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp

LENGTH = 10**7
_TAGS = ("train", "val", "en", "de", "fr", "photo", "scan", "synthetic")


class Records:
    """A ``records`` row: id str, int label, 16 float32 features, a 16-64 KB bytes blob, nested meta."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        self.features = rng.standard_normal((1024, 16), dtype=np.float32)

    def __call__(self, i: int) -> dict[str, Any]:
        h = (i * 2654435761) & 0xFFFFFFFF
        size = 16384 + h % (49152 + 1)
        start = (h >> 8) % (len(self.pool) - size)
        tags = [_TAGS[i % len(_TAGS)], _TAGS[h % len(_TAGS)]]
        return {
            "id": f"row-{i:08d}",
            "label": i % 1000,
            "features": self.features[i % 1024].copy(),
            "blob": self.pool[start : start + size],
            "meta": {"len": size, "tags": tags},
        }


class Blob:
    """A ``blobs`` sample: short id str, 32 float32 features, a 64 KB bytes payload, a small dict."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        self.features = rng.standard_normal((1024, 32), dtype=np.float32)

    def __call__(self, i: int) -> dict[str, Any]:
        start = ((i * 2654435761) & 0xFFFFFFFF) % (len(self.pool) - 65536)
        return {
            "id": f"s{i:05d}",
            "features": self.features[i % 1024].copy(),
            "payload": self.pool[start : start + 65536],
            "meta": {"index": i, "split": "train"},
        }


def tiny(i: int) -> torch.Tensor:
    """A ``tiny`` element: an int to a 4-float tensor."""
    return torch.tensor([i, i + 1, i + 2, i + 3], dtype=torch.float32) * 0.5


class Rows(torch.utils.data.Dataset):
    """``fn(i)`` for ``i`` in ``range(LENGTH)``, as ``bench/workloads.py``'s ``Mapped``."""

    def __init__(self, fn: Callable[[int], Any]) -> None:
        self.fn = fn

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> Any:
        return self.fn(i)


WORKLOADS: dict[str, tuple[Callable[[], Callable[[int], Any]], int]] = {
    "records": (Records, 32),
    "blobs": (Blob, 32),
    "tiny": (lambda: tiny, 256),
}


def plain(ds: Rows, batch: int) -> Iterator[Any]:
    for indices in BatchSampler(SequentialSampler(ds), batch, False):
        yield default_collate([ds[i] for i in indices])


def loaders(ds: Rows, batch: int) -> dict[str, Callable[[], Any]]:
    """Each configuration: a function that makes one pass's iterable."""
    return {
        "plain": lambda: plain(ds, batch),
        "torch0": lambda: torch.utils.data.DataLoader(ds, batch_size=batch),
        "tp0": lambda: tp.DataLoader(ds, batch_size=batch),
        "tp_auto": lambda: tp.DataLoader(ds, batch_size=batch, num_workers="auto"),
        "dsl": lambda: (
            tp.from_dataset(range(LENGTH))
            .map(ds.fn, tp.AUTOTUNE, executor="auto")
            .batch(batch)
            .prefetch(tp.AUTOTUNE)
        ),
        "dsl_ds": lambda: tp.from_dataset(ds).batch(batch),
        "dsl_inline": lambda: tp.from_dataset(ds).batch(batch).with_options(INLINE),
    }


INLINE = tp.Options(optimizations={"inject_prefetch": False})
"""The DSL with no prefetch thread: every call on the main thread, where the profile sees it."""


def where(iterable: Any, it: Any) -> str:
    """Where a ``tp.DataLoader(num_workers="auto")`` made its batches."""
    executors = getattr(it, "_executors", None)
    return f"{executors.kind}x{executors.workers}" if executors is not None else ""


def cpu_per_batch(
    make: Callable[[], Any], batches: int, warm: int
) -> tuple[float, float, float, str]:
    """Main-thread CPU, process CPU and wall seconds a batch over ``batches`` after ``warm``."""
    loader = make()
    it = iter(loader)
    for _ in range(warm):
        next(it)
    t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
    for _ in range(batches):
        next(it)
    t, p, w = time.thread_time() - t0, time.process_time() - p0, time.perf_counter() - w0
    placed = where(loader, it)
    del it, loader
    return t / batches, p / batches, w / batches, placed


def components(ds: Rows, batch: int, batches: int) -> dict[str, float]:
    """CPU seconds a batch of the plain loop's parts, each timed alone."""
    sampler = iter(BatchSampler(SequentialSampler(ds), batch, False))
    t0 = time.thread_time()
    index = [next(sampler) for _ in range(batches)]
    sample_s = (time.thread_time() - t0) / batches
    t0 = time.thread_time()
    for indices in index:
        rows = [ds[i] for i in indices]
    fetch_s = (time.thread_time() - t0) / batches
    t0 = time.thread_time()
    for _ in range(batches):
        default_collate(rows)
    collate_s = (time.thread_time() - t0) / batches
    return {"sampler": sample_s, "fetch": fetch_s, "collate": collate_s}


BUCKETS = (
    ("dataset", ("cheap_rows.py",)),
    ("sampler", ("utils/data/sampler.py",)),
    (
        "collate",
        (
            "_utils/collate.py",
            "torchpipe/ops/collate.py",
            "torchpipe/ops/fast_collate.py",
            "torchpipe/runtime/recycle.py",
        ),
    ),
    ("torch fetcher/iterator", ("utils/data/_utils/fetch.py", "utils/data/dataloader.py")),
    (
        "tp stats/clocks",
        (
            "torchpipe/core/stats.py",
            "torchpipe/autotune/",
            "torchpipe/runtime/timing.py",
            "torchpipe/observe/",
        ),
    ),
    (
        "tp placement/dispatch",
        (
            "torchpipe/runtime/placement/",
            "torchpipe/runtime/dispatch.py",
            "torchpipe/runtime/executor.py",
            "torchpipe/runtime/stall.py",
        ),
    ),
    ("tp seeding", ("torchpipe/randomness.py",)),
    ("tp loader/fetch", ("torchpipe/loader/",)),
    ("tp ops/core", ("torchpipe/ops/", "torchpipe/core/", "torchpipe/dataset.py")),
    ("transfer", ("torchpipe/runtime/processes/", "torchpipe/runtime/codec", "pin_memory.py")),
    ("other torchpipe", ("torchpipe/",)),
)


def bucket_of(filename: str) -> str:
    return next((name for name, parts in BUCKETS if any(p in filename for p in parts)), "other")


def profile(make: Callable[[], Any], batches: int, warm: int) -> dict[str, float]:
    """Main-thread seconds a batch in each bucket (builtins charged to their Python caller)."""
    it = iter(make())
    for _ in range(warm):
        next(it)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(batches):
        next(it)
    prof.disable()
    out: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if filename != "~":
            out[bucket_of(filename)] = out.get(bucket_of(filename), 0.0) + tottime / batches
            continue
        for (caller_file, _, _), (_, _, caller_tt, _) in callers.items():
            out[bucket_of(caller_file)] = out.get(bucket_of(caller_file), 0.0) + caller_tt / batches
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--configs", nargs="+", default=None)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warm", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.workloads:
        make_fn, batch = WORKLOADS[name]
        ds = Rows(make_fn())
        parts = [components(ds, batch, args.batches) for _ in range(args.repeat)]
        shown = ", ".join(
            f"{k} {statistics.median(p[k] for p in parts) * 1e6:.0f}" for k in parts[0]
        )
        print(f"\n{name} (batch {batch}): plain loop's parts, us CPU a batch: {shown}")
        print(
            f"  {'config':10} {'thread us':>10} {'process us':>11} {'wall us':>9} {'x plain':>8}  placed"
        )
        configs = loaders(ds, batch)
        names = args.configs or list(configs)
        runs: dict[str, list[tuple[float, float, float, str]]] = {config: [] for config in names}
        # rounds: a burst of other work on the machine hits every row alike
        for _ in range(args.repeat):
            for config in names:
                runs[config].append(cpu_per_batch(configs[config], args.batches, args.warm))
        for config in names:
            report(config, runs[config], runs.get("plain"))
            if args.profile:
                shares = profile(configs[config], args.batches, args.warm)
                total = sum(shares.values())
                top = sorted(shares.items(), key=lambda kv: -kv[1])
                print(
                    "    profiled, us a batch: "
                    + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in top if v / total > 0.01)
                )


def report(
    config: str, runs: list[tuple[float, float, float, str]], plain: list[Any] | None
) -> None:
    """A row: medians of main-thread CPU, process CPU, wall (us a batch), and of the process CPU's
    ratio to the plain loop's in the same round."""
    t, p, w = (statistics.median(r[k] for r in runs) * 1e6 for k in range(3))
    ratio = statistics.median(r[1] / q[1] for r, q in zip(runs, plain)) if plain else float("nan")
    placed = " ".join(sorted({r[3] for r in runs}))
    print(f"  {config:10} {t:10.0f} {p:11.0f} {w:9.0f} {ratio:8.2f}  {placed}", flush=True)


if __name__ == "__main__":
    main()

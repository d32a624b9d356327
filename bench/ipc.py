"""IPC throughput: torchpipe's process pool vs torch's DataLoader vs a plain memcpy, side by side.

Each worker builds a fresh payload per element (a tensor, a numpy array, bytes, or a dict of
them) and the main process receives it. Throughput is payload bytes received per second in the
main process. The memcpy row copies the same bytes once inside the main process: the ceiling.

Run: python bench/ipc.py [--workers 2] [--seconds 1.0] [--sizes 1K,512K,8M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp

SIZES = {
    "1K": 1 << 10,
    "16K": 16 << 10,
    "128K": 128 << 10,
    "512K": 512 << 10,
    "2M": 2 << 20,
    "8M": 8 << 20,
    "32M": 32 << 20,
}
KINDS = ("tensor", "numpy", "bytes", "dict")


class Payloads(torch.utils.data.Dataset):
    """Element i: a fresh payload of ``nbytes`` bytes of the given kind."""

    def __init__(self, kind: str, nbytes: int, count: int) -> None:
        self.kind, self.nbytes, self.count = kind, nbytes, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        value = i % 251
        if self.kind == "tensor":
            return torch.full((self.nbytes,), value, dtype=torch.uint8)
        if self.kind == "numpy":
            return np.full(self.nbytes, value, dtype=np.uint8)
        if self.kind == "bytes":
            return bytes([value]) * self.nbytes
        half = self.nbytes // 2
        return {
            "image": torch.full((half,), value, dtype=torch.uint8),
            "mask": np.full(self.nbytes - half, value, dtype=np.uint8),
            "label": i,
        }


def _identity(x):
    return x


def _count_for(nbytes: int, seconds: float) -> int:
    # aim for roughly `seconds` at ~1 GB/s, at least 40 and at most 20000 elements
    return int(min(20000, max(40, seconds * 1e9 / max(nbytes, 1))))


def _rate(iterable, nbytes: int) -> float:
    it = iter(iterable)
    next(it)  # exclude start-up (fork, first element) from the steady-state rate
    t0 = time.perf_counter()
    n = sum(1 for _ in it)
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def bench_torchpipe(kind: str, nbytes: int, workers: int, count: int) -> float:
    ds = tp.from_dataset(Payloads(kind, nbytes, count)).map(_identity, workers, executor="process")
    return _rate(ds, nbytes)


def bench_dataloader(kind: str, nbytes: int, workers: int, count: int) -> float:
    loader = torch.utils.data.DataLoader(
        Payloads(kind, nbytes, count), batch_size=None, num_workers=workers, prefetch_factor=2
    )
    return _rate(loader, nbytes)


def bench_torchpipe_batches(kind: str, nbytes: int, batch: int, workers: int, count: int) -> float:
    """Batches of ``batch`` elements: the worker maps and collates each batch into shared memory."""
    ds = tp.from_dataset(Payloads(kind, nbytes // batch, count * batch)).map(
        _identity, workers, executor="process"
    )
    return _rate(ds.batch(batch), nbytes)


def bench_dataloader_batches(kind: str, nbytes: int, batch: int, workers: int, count: int) -> float:
    loader = torch.utils.data.DataLoader(
        Payloads(kind, nbytes // batch, count * batch),
        batch_size=batch,
        num_workers=workers,
        prefetch_factor=2,
    )
    return _rate(loader, nbytes)


def bench_memcpy(nbytes: int, count: int) -> float:
    """One copy of the same bytes into a preallocated buffer, on one core: the ceiling (the
    best of three trials, since a ceiling is a best case)."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(count):
            np.copyto(dst, src)
        best = max(best, count * nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def bench_memcpy_cold(nbytes: int, count: int) -> float:
    """The same copy, cycling through 256 MB of sources: data that is not in cache, like fresh
    elements arriving from workers."""
    copies = max(2, (256 << 20) // max(nbytes, 1))
    sources = np.full((copies, nbytes), 7, dtype=np.uint8)
    dst = np.empty(nbytes, np.uint8)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(count):
            np.copyto(dst, sources[i % copies])
        best = max(best, count * nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _row(
    size: str, nbytes: int, kind: str, ours: float, theirs: float, memcpy: float, cold: float
) -> dict:
    print(
        f"{size:>6} {kind.split()[0]:>7} {ours:>9.2f}G {theirs:>9.2f}G {memcpy:>7.2f}G {cold:>6.2f}G  "
        f"{ours / theirs:>5.1f}x {ours / memcpy:>8.2f}x {ours / cold:>6.2f}x",
        flush=True,
    )
    return {
        "size": size,
        "bytes": nbytes,
        "kind": kind,
        "torchpipe_gbps": ours,
        "dataloader_gbps": theirs,
        "memcpy_gbps": memcpy,
        "memcpy_cold_gbps": cold,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=1.0, help="rough time per measurement")
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}"
    )
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument(
        "--batch", type=int, default=64, help="elements per batch in the batch section"
    )
    parser.add_argument(
        "--batch-sizes", default="2M,8M", help="batch sizes in bytes, from the same list"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = []
    print(f"workers={args.workers}, cores={os.cpu_count()}, torch {torch.__version__}")
    print(
        f"{'size':>6} {'kind':>7} {'torchpipe':>10} {'DataLoader':>10} {'memcpy':>8} {'cold':>7}  {'tp/DL':>6} "
        f"{'tp/memcpy':>9} {'tp/cold':>7}"
    )
    for size in args.sizes.split(","):
        nbytes = SIZES[size]
        count = _count_for(nbytes, args.seconds)
        memcpy, cold = bench_memcpy(nbytes, count), bench_memcpy_cold(nbytes, count)
        for kind in args.kinds.split(","):
            ours = bench_torchpipe(kind, nbytes, args.workers, count)
            theirs = bench_dataloader(kind, nbytes, args.workers, count)
            rows.append(_row(size, nbytes, kind, ours, theirs, memcpy, cold))
    print(f"\nbatches of {args.batch} elements (map + batch fused: collated in the worker)")
    for size in args.batch_sizes.split(","):
        nbytes = SIZES[size]
        count = _count_for(nbytes, args.seconds)
        memcpy, cold = bench_memcpy(nbytes, count), bench_memcpy_cold(nbytes, count)
        for kind in ("tensor", "numpy", "dict"):
            ours = bench_torchpipe_batches(kind, nbytes, args.batch, args.workers, count)
            theirs = bench_dataloader_batches(kind, nbytes, args.batch, args.workers, count)
            rows.append(_row(size, nbytes, f"{kind} batch", ours, theirs, memcpy, cold))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "cores": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

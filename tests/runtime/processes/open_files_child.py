"""Scenarios run in a fresh process under a low open-files limit (``RLIMIT_NOFILE``), for
tests/runtime/processes/test_descriptors.py: ``python -m tests.runtime.processes.open_files_child NAME``.
Each prints ``ok`` and what it checked, or raises."""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
from torch.utils.data import IterableDataset

import torchpipe as tp
from torchpipe.runtime.processes.descriptors import RECHECK_S
from torchpipe.runtime.processes.pool import ProcessPool

LIMIT = 100


class RandomDataset(IterableDataset):
    """torch's own test's dataset (test/test_dataloader.py, ``test_fd_limit_exceeded``)."""

    def __init__(self, length: int, size: tuple[int, ...]) -> None:
        self.length, self.size = length, size

    def __iter__(self):
        return self

    def __next__(self):
        if self.length <= 0:
            raise StopIteration
        self.length -= 1
        return torch.randn(self.size)


def torch_scenario(persistent: bool) -> None:
    """torch's test, verbatim but for the loader: either it works, or the error says what to do."""
    kept = []
    try:
        loader = tp.DataLoader(
            RandomDataset(200, (2, 2)),
            multiprocessing_context="fork",
            num_workers=1,
            persistent_workers=persistent,
        )
        for batch in loader:
            batch.max(dim=0)
            kept.append(batch)
    except RuntimeError as e:
        if "ulimit -n" not in str(e) or "set_sharing_strategy" not in str(e):
            raise
        print("raised", e)
        return
    assert len(kept) == 200, len(kept)
    print("ok kept", len(kept))


def square(x: int) -> torch.Tensor:
    return torch.full((64,), float(x))


def process_map() -> None:
    """A DSL map on worker processes whose every result the loop keeps."""
    ds = tp.range(300).map(square, num_parallel_calls=2, executor="process")
    kept = list(ds)
    assert [int(t[0]) for t in kept] == list(range(300))
    print("ok kept", len(kept))


def wide(x: int) -> torch.Tensor:
    return torch.full((20_000,), float(x))  # 160 KB


def reader(i: int) -> tp.Dataset:
    return tp.range(i * 200, i * 200 + 200).map(wide)


def interleave_processes() -> None:
    """An interleave whose readers run in worker processes, every element kept."""
    ds = tp.range(3).interleave(reader, cycle_length=3, num_parallel_calls=2, executor="process")
    kept = list(ds)
    expected = list(tp.range(3).interleave(reader, cycle_length=3))
    assert len(kept) == 600 and all(torch.equal(a, b) for a, b in zip(kept, expected))
    print("ok kept", len(kept))


def fill_descriptors() -> list[int]:
    """Open descriptors until the process is at its limit."""
    spare = []
    while True:
        try:
            spare.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return spare


def big_task(seq: int, x: int) -> torch.Tensor:
    return wide(x)  # a segment where the ring's slots are held


def collect(pool: ProcessPool, first: int, count: int) -> list[torch.Tensor]:
    """Results ``first`` .. ``first + count - 1`` (each task's payload is its seq), in order."""
    for seq in range(first, first + count):
        pool.submit(seq, seq)
    results: dict[int, torch.Tensor] = {}
    deadline = time.monotonic() + 30
    while len(results) < count and time.monotonic() < deadline:
        for seq, value, error in pool.collect(0.2):
            assert error is None and seq not in results, (seq, error)
            results[seq] = value
    assert sorted(results) == list(range(first, first + count)), sorted(results)
    return [results[seq] for seq in sorted(results)]


def at_the_limit(fill_at: int) -> None:
    """Every descriptor taken while results need them: from the start (the worker's ring does
    not arrive), or after ``fill_at`` results (the loop keeps every one, so the later ones go to
    one-off segments). The pool goes on without descriptors, loses and repeats nothing, and
    passes them again once there is room."""
    pool = ProcessPool(big_task, 1, "map(big)", per_worker=2)
    pool.start()
    kept = collect(pool, 0, fill_at) if fill_at else []
    spare = fill_descriptors()
    kept += collect(pool, fill_at, 40)
    assert pool.descriptors.shortages >= 1 and pool.descriptors.short
    for fd in spare:
        os.close(fd)
    time.sleep(RECHECK_S)
    kept += collect(pool, fill_at + 40, 40)
    assert not pool.descriptors.short  # room again: descriptors pass again
    assert all(torch.equal(t, big_task(i, i)) for i, t in enumerate(kept)), [
        int(t[0]) for t in kept
    ]
    pool.close()
    print("ok shortages", pool.descriptors.shortages)


def no_worker_at_the_limit() -> None:
    """A worker cannot be started with no descriptor free: a RuntimeError that says so."""
    ds = tp.range(10).map(square, num_parallel_calls=2, executor="process")
    spare = fill_descriptors()
    try:
        list(ds)
    except RuntimeError as e:
        for fd in spare:
            os.close(fd)
        if "ulimit -n" not in str(e) or f"limit of {LIMIT}" not in str(e):
            raise
        print("ok raised:", e)
        return
    raise AssertionError("no error at the open-files limit")


SCENARIOS = {
    "torch": lambda: torch_scenario(False),
    "torch_persistent": lambda: torch_scenario(True),
    "process_map": process_map,
    "interleave_processes": interleave_processes,
    "ring_lost": lambda: at_the_limit(0),
    "segment_lost": lambda: at_the_limit(20),
    "no_worker_at_the_limit": no_worker_at_the_limit,
}

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    SCENARIOS[sys.argv[1]]()

"""A preemptible training loop that tests/test_preemption.py runs in a subprocess and stops with SIGTERM.

Run as ``python -m tests.preemption_child CASE STATE_PATH [--no-handler]``. With a handler (the
recipe in docs/dataloader.md, "Preemption (SIGTERM)"), SIGTERM sets a flag; after the current batch the
loop saves the loader's (or the pipeline iterator's) state to ``STATE_PATH`` and exits 0. Where
``STATE_PATH`` exists the loop first loads it, so a second run finishes the epoch. Without a
handler SIGTERM ends the process at once.

It reports on stdout, a JSON line each: ``{"resumed_at": n}`` (the batches trained before),
then each batch, ``{"batch": [...], "pids": [...]}`` with the process's descendants at that
moment, then ``{"saved": n}`` or ``{"finished": n}`` with the batches trained in all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import torchpipe as tp

ROWS = 128
BATCH = 4
STEP_S = 0.05
"""The training step: long enough that SIGTERM lands mid-epoch however loaded the machine is."""


class Rows(Dataset):
    """Map-style rows that hold the GIL a moment (Python-heavy items: "auto" puts them on processes)."""

    def __init__(self, n: int = ROWS) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        deadline = time.perf_counter() + 0.001
        while time.perf_counter() < deadline:
            pass
        return i


class Stream(IterableDataset):
    """Rows as a stream, every worker its share (torch's idiom)."""

    def __init__(self, n: int = ROWS) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(first, self.n, step):
            time.sleep(0.001)
            yield i


def double(i: int) -> int:
    """The DSL's map function (module level: the process map's workers run it)."""
    time.sleep(0.001)
    return 2 * i


def _shuffled() -> torch.Generator:
    return torch.Generator().manual_seed(0)


CASES = {
    "loader": lambda: tp.DataLoader(
        Rows(), batch_size=BATCH, shuffle=True, num_workers=2, generator=_shuffled()
    ),
    "auto": lambda: tp.DataLoader(
        Rows(), batch_size=BATCH, shuffle=True, num_workers="auto", generator=_shuffled()
    ),
    "pipeline": lambda: tp.from_dataset(Rows()).map(double, 2, executor="process").batch(BATCH),
}
"""What the loop iterates over, by name: each builds it afresh, the same way in every process."""


def _report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)  # the test reads stdout line by line, as it comes


def _descendants() -> list[int]:
    return sorted(p.pid for p in psutil.Process().children(recursive=True))


def _save(state: dict[str, Any], path: str) -> None:
    """Write ``state`` so that a kill in the middle leaves the previous file, never half of one."""
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def run(case: str, state_path: str, handler: bool) -> int:
    """The training loop: one epoch, or up to SIGTERM where ``handler``; returns the exit code.

    The "model" is the count of batches trained, saved with the loader's state as docs/dataloader.md's
    recipe saves a model's, so a resume shows that the two were saved at the same batch.
    """
    stop = threading.Event()
    if handler:  # before the loader is built, as a training script does: its workers inherit it
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    made = CASES[case]()
    trained = torch.zeros((), dtype=torch.int64)
    checkpoint = (
        torch.load(state_path) if os.path.exists(state_path) else None
    )  # weights_only: plain data
    batches = made if isinstance(made, tp.DataLoader) else iter(made)
    if checkpoint is not None:
        trained = checkpoint["model"]
        batches.load_state_dict(checkpoint["data"])  # a DataLoader, or a pipeline's iterator
    _report(resumed_at=int(trained))
    state_dict = batches.state_dict
    for batch in batches:
        time.sleep(STEP_S)  # the training step
        trained += 1
        _report(batch=batch.tolist(), pids=_descendants())
        if stop.is_set():  # the current batch is done: save where the epoch is, and leave
            _save({"data": state_dict(), "model": trained}, state_path)
            _report(saved=int(trained))
            return 0
    _report(finished=int(trained))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("state_path")
    parser.add_argument(
        "--no-handler", action="store_true", help="leave SIGTERM's default action: end at once"
    )
    args = parser.parse_args(argv)
    return run(args.case, args.state_path, handler=not args.no_handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

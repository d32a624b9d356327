"""Pipelines that tests save, snapshot and kill in a child process (``python -m tests.storage.saving_jobs``).

The functions live here so that the child and the test build the same pipeline: same ops, same
functions' code, so the same fingerprint.
"""

import os
import pickle
import signal
import sys
import time

import torch

import torchpipe as tp

CALLS = []  # a list, not a number: the fingerprint sees plain constants a function names, not lists
SLOW = [0.0]


def make(i):
    CALLS.append(i)
    time.sleep(SLOW[0])
    return {"x": torch.full((3,), float(i)), "i": i, "name": f"e{i}"}


def pipeline(n):
    return tp.range(n).map(make)


def snapshot_until_killed(path, n, stop, state_file):
    """Read ``stop`` elements of the snapshot's filling pass, save the checkpoint, die by SIGKILL."""
    it = iter(pipeline(n).snapshot(path))
    for _ in range(stop):
        next(it)
    with open(state_file, "wb") as f:
        pickle.dump(it.state_dict(), f)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv):
    kind, path, n, slow = argv[0], argv[1], int(argv[2]), float(argv[3])
    SLOW[0] = slow
    if kind == "save":
        pipeline(n).save(path, checkpoint_args={"checkpoint_interval": 10})
    elif kind == "snapshot":
        for _ in pipeline(n).snapshot(path):
            pass
    else:
        snapshot_until_killed(path, n, int(argv[4]), argv[5])
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

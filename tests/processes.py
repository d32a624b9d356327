"""Helpers for tests that watch processes come and go."""

import os
import time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def dev_shm(mine=None) -> set[str]:
    """The entries in /dev/shm, less torch's own files of processes other than ``mine`` (default:
    this one): torch names them ``torch_<pid>_...``, and another test's DataLoader may make one
    at any time (the suite runs tests side by side)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    mine = {os.getpid()} if mine is None else set(mine)
    kept = set()
    for name in os.listdir("/dev/shm"):
        parts = name.split("_")
        if (
            parts[0] == "torch"
            and len(parts) > 1
            and parts[1].isdigit()
            and int(parts[1]) not in mine
        ):
            continue
        kept.add(name)
    return kept

"""Talking to the other ranks: rank 0's seed, and the ranks' agreement on a pass's end."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_WAIT_S = 1800.0
"""How long a collective waits for the other ranks where ``Options.stall_timeout`` is None."""


# -- talking to the other ranks -------------------------------------------------------------------
def broadcast_seed(seed: int, wait_s: float | None) -> int:
    """Rank 0's ``seed``, on every rank (a collective on the default group)."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    work = dist.broadcast(value, src=0, async_op=True)
    _wait(
        work,
        wait_s,
        "rank 0's seed for the pass (every rank iterates the pipeline, or give it tp.Options(seed=...))",
    )
    return int(value.item())


class PassGroup:
    """The ranks' agreement for one pass, on a gloo process group of its own.

    A pass whose ranks' lengths are not known ahead agrees at every element whether to go on;
    its own group keeps those collectives apart from the training loop's (DDP's on the default
    group) and from other passes' (a validation pass beside a training one).

    Args:
        wait_s: how long a collective waits for the other ranks (None: 30 minutes).
    """

    def __init__(self, wait_s: float | None) -> None:
        self._wait_s = wait_s
        self._group: Any = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closing = False

    def open(self) -> None:
        """Make the group; every rank calls it, in the same order as its other groups."""
        if self._group is not None or self._closing:
            raise RuntimeError("a pass's agreement is opened once")
        timeout = datetime.timedelta(seconds=self._wait_s or DEFAULT_WAIT_S)
        self._group = dist.new_group(backend="gloo", timeout=timeout)

    def all(self, value: bool) -> bool:
        return self._reduce(value, dist.ReduceOp.MIN)

    def any(self, value: bool) -> bool:
        return self._reduce(value, dist.ReduceOp.MAX)

    def _reduce(self, value: bool, op: Any) -> bool:
        with self._lock:
            if self._group is None or self._closing:
                raise RuntimeError("the ranks' agreement is closed (the pass was closed)")
            group = self._group
            self._in_flight += 1
        try:
            flag = torch.tensor([int(value)], dtype=torch.int32)
            _wait(
                dist.all_reduce(flag, op=op, group=group, async_op=True),
                self._wait_s,
                "the other ranks to agree whether the pass goes on (do all ranks iterate it?)",
            )
            return bool(flag.item())
        finally:
            with self._lock:
                self._in_flight -= 1
                last = self._closing and not self._in_flight
            if last:
                self._destroy()

    def close(self) -> None:
        """Drop the group, now or, where a collective is still waiting on it, when that ends
        (destroying a group under a waiting collective would wait with it)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            waiting = self._in_flight
        if not waiting:
            self._destroy()

    def _destroy(self) -> None:
        with self._lock:
            group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # the default group went first: nothing left to drop
                pass


def _wait(work: Any, wait_s: float | None, what: str) -> None:
    seconds = wait_s or DEFAULT_WAIT_S
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {dist.get_rank()} waited up to {seconds:g} s for {what}: {e}"
        ) from e

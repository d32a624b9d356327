"""A few processes on 127.0.0.1 in one gloo process group, running test scenarios on every rank.

Starting processes and a process group costs seconds; scenarios cost milliseconds. So a test
module starts a ``Cluster`` once (a fixture) and runs each scenario on it: ``cluster.run(fn,
*args)`` calls ``fn(*args)`` on every rank (``fn`` a module-level function, found by name in the
rank's process) and returns the results by rank. Every wait is bounded: a scenario that does not
finish in time fails the test and stops the cluster (the fixture makes a new one for the next).
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

START_S = 60.0
"""How long the ranks may take to start and join their process group."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScenarioError(AssertionError):
    """A scenario raised on a rank; the message holds that rank's traceback."""


class Cluster:
    """``world_size`` ranks in a gloo process group on 127.0.0.1.

    Args:
        world_size: the number of ranks.
    """

    def __init__(self, world_size: int) -> None:
        # a fresh interpreter: no state of the test process
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self._results = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world_size)]
        port = free_port()
        self._processes = [
            # not daemonic: a rank starts DataLoader workers of its own
            context.Process(
                target=_serve, args=(rank, world_size, port, self._inboxes[rank], self._results)
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self._collect(START_S, "start")

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        per_rank: list[tuple] | None = None,
        timeout: float = 30.0,
        **kwargs: Any,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` (or ``fn(*per_rank[rank], **kwargs)``) on every rank; the results by rank.

        Raises:
            ScenarioError: where a rank raised (its traceback in the message).
            TimeoutError: where a rank did not finish within ``timeout`` seconds; the cluster
                is stopped.
        """
        for rank, inbox in enumerate(self._inboxes):
            inbox.put(
                (
                    fn.__module__,
                    fn.__qualname__,
                    per_rank[rank] if per_rank is not None else args,
                    kwargs,
                )
            )
        return self._collect(timeout, fn.__qualname__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: list[str] = []
        while len(results) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(0.01, min(left, 1.0)))
            except queue.Empty:
                if left <= 0 or not all(p.is_alive() for p in self._processes):
                    self.close()
                    raise TimeoutError(
                        f"{what}: ranks {sorted(set(range(self.world_size)) - set(results))} did not "
                        f"answer within {timeout:g} s (or died)"
                    ) from None
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise ScenarioError(f"{what} failed:\n" + "\n".join(errors))
        return [results[rank] for rank in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(process.is_alive() for process in self._processes)

    def close(self) -> None:
        """Stop the ranks (asked first, killed where they do not go within seconds)."""
        for inbox in self._inboxes:
            inbox.put(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def _serve(rank: int, world_size: int, port: int, inbox: Any, results: Any) -> None:
    import torch.distributed as dist

    # As a process torchrun starts: no start method chosen (spawn's preparation set one).
    multiprocessing.set_start_method(None, force=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=START_S),
        )
        results.put((rank, True, None))
    except Exception:  # noqa: BLE001 - reported to the test
        results.put((rank, False, traceback.format_exc()))
        return
    parent = os.getppid()
    while True:
        try:
            message = inbox.get(timeout=1)
        except queue.Empty:
            if os.getppid() != parent:
                break  # the test process is gone
            continue
        if message is None:
            break
        module, name, args, kwargs = message
        try:
            fn: Any = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()

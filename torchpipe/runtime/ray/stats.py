"""What a Ray actor pool counts: each actor's calls and restarts, and what receiving results cost
this process (``it.stats()``'s ``ray`` section, ``RayActorPool.report``)."""

from __future__ import annotations

from typing import Any


class ActorStats:
    """One actor's calls: how many, their wall and CPU seconds there, and its restarts."""

    __slots__ = ("calls", "work_s", "cpu_s", "restarts")

    def __init__(self) -> None:
        self.calls, self.work_s, self.cpu_s, self.restarts = 0, 0.0, 0.0, 0

    def call(self, wall_s: float, cpu_s: float) -> None:
        self.calls += 1
        self.work_s += wall_s
        self.cpu_s += cpu_s

    def as_dict(self) -> dict[str, Any]:
        per_call = self.work_s / self.calls if self.calls else 0.0
        return {
            "calls": self.calls,
            "call_s": per_call,
            "cpu_s": self.cpu_s,
            "restarts": self.restarts,
        }


class PoolStats:
    """What receiving results cost this process: fetching each from the object store and
    decoding it (the transfer's share that waits on the network is in the wait for it)."""

    __slots__ = ("results", "bytes", "transfer_s")

    def __init__(self) -> None:
        self.results, self.bytes, self.transfer_s = 0, 0, 0.0

    def received(self, nbytes: int, seconds: float) -> None:
        self.results += 1
        self.bytes += nbytes
        self.transfer_s += seconds

    def as_dict(self, actors: dict[str, dict[str, Any]]) -> dict[str, Any]:
        per_result = self.transfer_s / self.results if self.results else 0.0
        rate = self.bytes / self.transfer_s if self.transfer_s > 0 else 0.0
        return {
            "results": self.results,
            "bytes": self.bytes,
            "transfer_s": per_result,
            "transfer_bytes_per_s": rate,
            "actors": actors,
        }

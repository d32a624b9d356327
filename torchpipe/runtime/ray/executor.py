"""Ray as an executor: a parallel stage's calls on Ray actors, anywhere on a Ray cluster.

``map(fn, num_parallel_calls=N, executor="ray")`` (and ``interleave(..., executor="ray")``) runs
the stage's calls on a pool of Ray actors (``runtime/ray/pool.py``) through the same
dispatcher as every other executor: the same order, seeds, checkpoints and output as worker
processes. :class:`RayExecutor` carries the options (how many actors, what each reserves, where
they go, which cluster). Ray is imported only when a stage asks for it: ``require_ray`` names the
extra that installs it. See docs/scale_out.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torchpipe.constants import AUTOTUNE
from torchpipe.runtime.placement.costs import RAY
from torchpipe.runtime.ray.actors import require_ray

__all__ = ["RAY", "RayExecutor", "require_ray", "resolve"]


@dataclasses.dataclass(frozen=True)
class RayExecutor:
    """Options of ``executor=tp.RayExecutor(...)``: a stage's calls on Ray actors.

    ``executor="ray"`` is ``RayExecutor()``. Each actor runs one call at a time (so the global
    RNGs are seeded per element, as in a worker process) and keeps a few calls queued.

    Args:
        num_actors: how many actors: an int, ``tp.AUTOTUNE`` (the autotuner sizes the pool
            between ``min_actors`` and ``max_actors`` within the cluster's free CPUs), or None
            to follow the stage's ``num_parallel_calls``.
        min_actors: the fewest actors the autotuner keeps.
        max_actors: the most actors the autotuner asks for (None: as many as the cluster's free
            CPUs allow).
        num_cpus: CPUs each actor reserves on the cluster (its torch threads follow it).
        num_gpus: GPUs each actor reserves.
        resources: custom resources each actor reserves, e.g. ``{"preprocess": 1}`` to place
            actors on the nodes that offer it.
        scheduling_strategy: where actors go: ``"SPREAD"``, ``"DEFAULT"``, or a Ray strategy
            object (a placement group's, a node affinity).
        address: the cluster to connect to when this process is not connected yet (``"auto"``,
            ``"ray://head:10001"``); None connects as ``ray.init()`` does (``RAY_ADDRESS``, a
            cluster started on this machine, else a new local one).
        runtime_env: the actors' Ray runtime environment (e.g. ``{"pip": ["torchpipe"]}`` on a
            cluster whose nodes lack it).
        tasks_per_actor: calls queued on each actor at once, hiding Ray's round trip.

    Raises:
        TypeError, ValueError: for options of the wrong type or range.
    """

    kind: ClassVar[str] = RAY

    num_actors: int | None = None
    min_actors: int = 1
    max_actors: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] | None = None
    scheduling_strategy: Any = None
    address: str | None = None
    runtime_env: dict[str, Any] | None = None
    tasks_per_actor: int = 4

    def __post_init__(self) -> None:
        if self.num_actors is not None and self.num_actors != AUTOTUNE:
            _check_int("num_actors", self.num_actors, 1)
        _check_int("min_actors", self.min_actors, 1)
        if self.max_actors is not None:
            _check_int("max_actors", self.max_actors, self.min_actors)
        _check_number("num_cpus", self.num_cpus)
        _check_number("num_gpus", self.num_gpus)
        _check_int("tasks_per_actor", self.tasks_per_actor, 1)
        if self.resources is not None:
            if not isinstance(self.resources, dict) or not all(
                isinstance(k, str) for k in self.resources
            ):
                raise TypeError(
                    f"RayExecutor: resources must be a dict of str to numbers, got {self.resources!r}"
                )
            for name, amount in self.resources.items():
                _check_number(f"resources[{name!r}]", amount)
        if self.address is not None and not isinstance(self.address, str):
            raise TypeError(
                f"RayExecutor: address must be a str, got {type(self.address).__name__}"
            )
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise TypeError(
                f"RayExecutor: runtime_env must be a dict, got {type(self.runtime_env).__name__}"
            )

    def actor_options(self, restart: bool) -> dict[str, Any]:
        """The ``.options(...)`` of each actor: what it reserves, where it goes, and Ray's restart
        of a dead actor (``restart``); a call lost with its actor is sent again by the pool, not
        retried by Ray, so that each result comes from one call."""
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "max_restarts": -1 if restart else 0,
            "max_task_retries": 0,
        }
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.scheduling_strategy is not None:
            options["scheduling_strategy"] = self.scheduling_strategy
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        return options

    def parallelism(self, num_parallel_calls: int | None) -> int | None:
        """The stage's parallelism: ``num_actors`` where set, else ``num_parallel_calls``."""
        return self.num_actors if self.num_actors is not None else num_parallel_calls

    def pool(self, handler: Any, size: int, name: str, *, restart: bool, timing: Any) -> Any:
        """A :class:`~torchpipe.runtime.ray.pool.RayActorPool` of ``size`` actors running
        ``handler`` (the ops build their Ray executors through this, never importing Ray's code)."""
        from torchpipe.runtime.ray.pool import RayActorPool

        return RayActorPool(handler, size, name, self, restart=restart, timing=timing)

    def __repr__(self) -> str:
        """``RayExecutor(...)`` with the options that differ from the defaults (for ``explain()``)."""
        changed = [
            f"{field.name}={getattr(self, field.name)!r}"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != field.default
        ]
        return f"RayExecutor({', '.join(changed)})"


def resolve(executor: Any) -> RayExecutor | None:
    """The :class:`RayExecutor` of an ``executor=`` argument, or None if it does not ask for Ray."""
    if isinstance(executor, RayExecutor):
        return executor
    return RayExecutor() if executor == RAY else None


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"RayExecutor: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"RayExecutor: {name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"RayExecutor: {name} must be a number, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"RayExecutor: {name} must be >= 0, got {value}")

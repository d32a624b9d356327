"""The autotuner's reading of a stage: what :class:`~torchpipe.core.tunable.Tunable` answers, with
the defaults every other iterator gets (it runs on its caller's thread)."""

from __future__ import annotations

from typing import Any

from torchpipe.core.tunable import BUFFER, POOL, Tunable
from torchpipe.runtime.knob import LiveKnob

__all__ = [
    "BUFFER",
    "POOL",
    "Tunable",
    "buffer_slots",
    "calls_in_processes",
    "calls_on_cluster",
    "knobs",
    "parallelism",
    "role",
]


def role(stage: Any) -> str | None:
    """``"pool"``, ``"buffer"``, or None for a stage on its caller's thread."""
    return stage.tuning_role if isinstance(stage, Tunable) else None


def knobs(stage: Any) -> list[LiveKnob]:
    """The stage's live knobs (none for a stage that is not :class:`Tunable`)."""
    return stage.knobs() if role(stage) is not None else []


def parallelism(stage: Any) -> int:
    return stage.parallelism() if role(stage) == POOL else 1


def buffer_slots(stage: Any) -> int:
    return stage.buffer_slots() if role(stage) is not None else 0


def calls_in_processes(stage: Any) -> bool:
    return role(stage) == POOL and stage.calls_in_processes()


def calls_on_cluster(stage: Any) -> bool:
    """Whether a pool's calls run on a cluster's CPUs (Ray actors), which the machine's CPU
    budget does not count: its knob's maximum is what the cluster has free."""
    return role(stage) == POOL and stage.calls_on_cluster()

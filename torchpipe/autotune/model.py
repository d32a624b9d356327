"""A performance model of a pipeline: predicted time per root element for any setting of the knobs.

The pipeline is seen as a line of *segments* separated by asynchronous boundaries (a parallel
stage's in-flight window, a prefetch buffer); the consumer (the training step) is the last one.
Each segment has a service time per root element: its work (self time of its ops, scaled by how
many of their elements make one root element) divided by its parallelism. Between two segments
sits a bounded buffer; like tf.data, the model charges it the cost of an M/M/1/K queue: a producer
with service time ``a`` feeding a consumer with service time ``b`` through ``K`` slots delivers an
element every ``b / (1 - p0)`` seconds, where ``p0`` is the probability that the buffer is empty,
``(1 - r) / (1 - r**(K + 1))`` with ``r = b / a``. The line's time per element is the largest
of these (its bottleneck, with the stall its buffers cannot hide).

Everything here is pure arithmetic on measured numbers, so it is tested with made-up timings.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Knob:
    """A tunable value: a stage's parallelism or a buffer's depth.

    Attributes:
        name: unique within a pipeline, e.g. ``map(decode).parallelism``.
        value: the current value.
        minimum, maximum: its range.
    """

    name: str
    value: int
    minimum: int = 1
    maximum: int = 64


@dataclasses.dataclass(frozen=True)
class Stage:
    """One segment of the line, leaf first in a list.

    Attributes:
        name: for reports.
        work_s: seconds of work per root element (self time per element x elements per root
            element); for the consumer, its step time per root element.
        parallelism: the name of the knob that divides ``work_s`` (None: one at a time).
        buffer: the name of the knob giving the depth of the buffer after this segment (None:
            no buffer, it runs on its consumer's thread: its work adds to the next segment's).
        slots_per_unit: buffer slots per unit of the ``buffer`` knob (a pool of processes that
            keeps 2 tasks per worker in flight has 2 slots per unit of its parallelism).
        per_unit: the name of the knob giving the slots per unit instead (a process map's tasks
            in flight per worker, which the tuner may raise); None: ``slots_per_unit``.
        cpu_fraction: CPU seconds per second of work (1 for compute, near 0 for waiting on I/O).
        bytes_per_element: bytes one element in its buffer or in flight holds.
    """

    name: str
    work_s: float
    parallelism: str | None = None
    buffer: str | None = None
    cpu_fraction: float = 1.0
    bytes_per_element: float = 0.0
    slots_per_unit: int = 1
    per_unit: str | None = None


def slots_at(stage: Stage, knobs: dict[str, int]) -> int:
    """The slots of the buffer after ``stage`` at these knob values (0: no buffer)."""
    if stage.buffer is None:
        return 0
    return knobs[stage.buffer] * (
        knobs[stage.per_unit] if stage.per_unit is not None else stage.slots_per_unit
    )


def empty_probability(ratio: float, slots: int) -> float:
    """``p0`` of an M/M/1/K queue with ``K = slots`` and load ``ratio`` (consumer / producer time)."""
    if slots < 1:
        return 1.0
    if abs(ratio - 1.0) < 1e-9:
        return 1.0 / (slots + 1)
    # compute with 1 / ratio to avoid overflow: p0 = r^-K (1/r - 1) / (1/r^(K+1) - 1)
    if ratio > 1.0:
        inv = 1.0 / ratio
        return (inv**slots) * (1.0 - inv) / (1.0 - inv ** (slots + 1))
    return (1.0 - ratio) / (1.0 - ratio ** (slots + 1))


def segments(stages: list[Stage]) -> list[tuple[list[Stage], str | None]]:
    """The stages grouped into segments: runs of stages ending at a buffer (or at the end)."""
    out: list[tuple[list[Stage], str | None]] = []
    current: list[Stage] = []
    for stage in stages:
        current.append(stage)
        if stage.buffer is not None:
            out.append((current, stage.buffer))
            current = []
    if current:
        out.append((current, None))
    return out


def service_times(stages: list[Stage], knobs: dict[str, int]) -> list[tuple[float, int]]:
    """Per segment: seconds per root element, and the slots of the buffer that follows it (0: none)."""
    result = []
    for group, _ in segments(stages):
        total = sum(_time(stage, knobs) for stage in group)
        result.append((total, slots_at(group[-1], knobs)))
    return result


def predict_time(stages: list[Stage], knobs: dict[str, int]) -> float:
    """Predicted seconds per root element at the consumer, leaf-first ``stages``, knob values ``knobs``."""
    times = service_times(stages, knobs)
    worst = max(t for t, _ in times)
    for (producer, slots), (consumer, _) in zip(times, times[1:]):
        # nothing in between (a pool of 0: calls on its consumer's thread): they take turns
        if slots == 0:
            worst = max(worst, producer + consumer)
            continue
        if producer <= 0.0:
            continue
        p0 = empty_probability(consumer / producer, slots)
        pair = consumer / (1.0 - p0) if p0 < 1.0 else math.inf
        worst = max(worst, min(pair, producer + consumer))
    return worst


def bottleneck(stages: list[Stage], knobs: dict[str, int]) -> str:
    """The stage that costs most in the slowest segment: what limits the line."""
    slowest, worst = [], -1.0
    for group, _ in segments(stages):
        total = sum(_time(stage, knobs) for stage in group)
        if total > worst:
            slowest, worst = group, total
    return max(slowest, key=lambda stage: _time(stage, knobs)).name if slowest else ""


def _time(stage: Stage, knobs: dict[str, int]) -> float:
    parallel = knobs[stage.parallelism] if stage.parallelism is not None else 1
    return stage.work_s / max(parallel, 1)


def cpu_cores(stages: list[Stage], knobs: dict[str, int]) -> float:
    """Cores the pipeline keeps busy at the predicted rate (what the CPU budget limits)."""
    period = predict_time(stages, knobs)
    if period <= 0.0 or math.isinf(period):
        return 0.0
    return sum(stage.work_s * stage.cpu_fraction for stage in stages) / period


def memory_bytes(stages: list[Stage], knobs: dict[str, int]) -> float:
    """Bytes held by buffers and in-flight elements (what the RAM budget limits)."""
    total = 0.0
    for stage in stages:
        held = slots_at(stage, knobs)
        if stage.parallelism is not None:
            held += knobs[stage.parallelism]
        total += held * stage.bytes_per_element
    return total

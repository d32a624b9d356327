"""Hill-climbing the knobs of a pipeline model under a CPU and a RAM budget.

At each step every knob is tried one notch up (parallelism +1; a buffer doubled), and the move that
cuts the predicted time per element most is taken, as long as the pipeline stays within its
budgets: the cores it would keep busy (the consumer's own share counts; ``CPU_TOLERANCE`` over is
allowed) and the bytes its buffers and in-flight elements would hold. The climb stops when no move
gains at least ``min_gain``.
Knobs never go below their current value unless a budget is exceeded, in which case the most
memory- or CPU-hungry knob is brought down first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import psutil

from torchpipe.autotune.model import Knob, Stage, cpu_cores, memory_bytes, predict_time
from torchpipe.runtime.cpu import usable_cpu_count

RAM_SHARE = 0.5
"""The share of the memory available when a pipeline starts that its RAM budget is by default."""
CPU_TOLERANCE = 0.1
"""Share of the CPU budget a setting may exceed: measured CPU shares (0.98 a worker, plus the main
thread's bits) must not keep one CPU-bound worker per core out of reach."""
_MAX_STEPS = 512


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the pipeline may use.

    Attributes:
        cpu: cores (usable cores from affinity and the cgroup quota, by default).
        ram: bytes for buffers and elements in flight (half the available memory, by default).
    """

    cpu: float
    ram: float

    @classmethod
    def of_machine(cls, cpu: float | None = None, ram: float | None = None) -> Budget:
        """The defaults, with ``cpu`` / ``ram`` overriding them where given."""
        cores = float(usable_cpu_count()) if cpu is None else float(cpu)
        memory = psutil.virtual_memory().available * RAM_SHARE if ram is None else float(ram)
        return cls(max(cores, 1.0), max(memory, 0.0))


def _up(knob: Knob, value: int, is_buffer: bool) -> int:
    return min(knob.maximum, value * 2 if is_buffer else value + 1)


def _fits(stages: list[Stage], values: dict[str, int], budget: Budget) -> bool:
    cpu_ok = cpu_cores(stages, values) <= budget.cpu * (1.0 + CPU_TOLERANCE) + 1e-9
    return cpu_ok and memory_bytes(stages, values) <= budget.ram


def hill_climb(
    stages: list[Stage], knobs: list[Knob], budget: Budget, min_gain: float = 0.01
) -> dict[str, int]:
    """The knob values the model prefers, starting from the knobs' current values.

    Args:
        stages: the pipeline model, leaf first (the consumer last).
        knobs: every knob the stages name.
        budget: the CPU and RAM budget.
        min_gain: the least relative cut in predicted time a move must bring.
    """
    by_name = {k.name: k for k in knobs}
    # Buffer depths (and a pool's tasks in flight per worker) move in powers of two; a pool's
    # window is its parallelism, which moves by one.
    buffers = {s.buffer for s in stages if s.buffer is not None} - {s.parallelism for s in stages}
    buffers |= {s.per_unit for s in stages if s.per_unit is not None}
    values = {k.name: max(k.minimum, min(k.maximum, k.value)) for k in knobs}
    values = _shrink_to_budget(stages, values, by_name, buffers, budget)
    current = predict_time(stages, values)
    for _ in range(_MAX_STEPS):
        best_name, best_time = None, current
        for name, knob in by_name.items():
            raised = _up(knob, values[name], name in buffers)
            if raised == values[name]:
                continue
            trial = {**values, name: raised}
            if not _fits(stages, trial, budget):
                continue
            predicted = predict_time(stages, trial)
            if predicted < best_time:
                best_name, best_time = name, predicted
        if best_name is None or best_time > current * (1.0 - min_gain):
            break
        values[best_name] = _up(by_name[best_name], values[best_name], best_name in buffers)
        current = best_time
    return values


def _shrink_to_budget(
    stages: list[Stage],
    values: dict[str, int],
    knobs: dict[str, Knob],
    buffers: set[str],
    budget: Budget,
) -> dict[str, int]:
    """Lower knobs (biggest memory holders first, then parallelism) until the budget holds."""
    values = dict(values)
    for _ in range(_MAX_STEPS):
        if _fits(stages, values, budget):
            break
        candidates = [n for n in values if values[n] > knobs[n].minimum]
        if not candidates:
            break
        over_ram = memory_bytes(stages, values) > budget.ram

        def saving(name: str) -> float:
            lowered = {**values, name: _down(values[name], knobs[name], name in buffers)}
            if over_ram:  # noqa: B023 - max() calls it in this iteration
                return memory_bytes(stages, values) - memory_bytes(stages, lowered)
            return cpu_cores(stages, values) - cpu_cores(stages, lowered)

        name = max(candidates, key=saving)
        values[name] = _down(values[name], knobs[name], name in buffers)
    return values


def _down(value: int, knob: Knob, is_buffer: bool) -> int:
    return max(knob.minimum, value // 2 if is_buffer else value - 1)


def backoff_intervals(
    first_s: float = 0.05, last_s: float = 2.0, factor: float = 1.5
) -> Iterator[float]:
    """Seconds between re-optimizations: often at first, then backing off to ``last_s``."""
    interval = first_s
    while True:
        yield interval
        interval = min(last_s, interval * factor)

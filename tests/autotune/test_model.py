"""The performance model: M/M/1/K buffers, segments, and predictions from made-up timings."""

import math

import pytest

from tests.autotune.simulated import pipeline
from torchpipe.autotune.model import (
    cpu_cores,
    empty_probability,
    memory_bytes,
    predict_time,
    segments,
)


def test_empty_probability_of_small_queues():
    assert empty_probability(1.0, 1) == pytest.approx(0.5)
    assert empty_probability(1.0, 3) == pytest.approx(0.25)
    # an infinitely fast producer: never empty
    assert empty_probability(0.0, 4) == pytest.approx(1.0)
    assert empty_probability(0.5, 1) == pytest.approx(2 / 3)
    assert empty_probability(2.0, 1) == pytest.approx(1 / 3)
    assert empty_probability(1e6, 8) == pytest.approx(0.0, abs=1e-9)  # no overflow for big loads
    assert all(empty_probability(0.9, k) > empty_probability(0.9, k + 1) for k in range(1, 10))


def test_segments_split_at_buffers():
    groups = segments(pipeline())
    assert [[s.name for s in g] for g, _ in groups] == [["source", "map", "batch"], ["consumer"]]
    assert [b for _, b in groups] == ["depth", None]


def test_parallelism_divides_the_work_of_its_stage():
    one = predict_time(pipeline(), {"p": 1, "depth": 64})
    four = predict_time(pipeline(), {"p": 4, "depth": 64})
    assert one == pytest.approx(1e-3 + 2.5e-5, rel=1e-3)
    assert four == pytest.approx(2.5e-4 + 2.5e-5, rel=1e-3)


def test_a_shallow_buffer_between_equal_speeds_costs_a_stall():
    stages = pipeline(map_s=1e-3, step_s=1.025e-3)
    shallow = predict_time(stages, {"p": 1, "depth": 1})
    deep = predict_time(stages, {"p": 1, "depth": 32})
    # one slot: producer and consumer alternate
    assert shallow == pytest.approx(1.025e-3 + 1.025e-3, rel=0.05)
    assert deep < 1.1 * 1.025e-3 < shallow


def test_more_of_any_knob_never_predicts_slower():
    stages = pipeline(step_s=4e-4)
    for p in range(1, 8):
        for depth in (1, 2, 4, 8):
            t = predict_time(stages, {"p": p, "depth": depth})
            assert predict_time(stages, {"p": p + 1, "depth": depth}) <= t + 1e-15
            assert predict_time(stages, {"p": p, "depth": depth * 2}) <= t + 1e-15


def test_cpu_and_memory_use():
    stages = pipeline(cpu=0.1, element=1e6)
    knobs = {"p": 4, "depth": 8}
    period = predict_time(stages, knobs)
    assert cpu_cores(stages, knobs) == pytest.approx((5e-6 + 1e-4 + 2e-5) / period)
    assert memory_bytes(stages, knobs) == pytest.approx((4 + 8) * 1e6)
    assert not math.isinf(period)

"""The hill-climb on simulated pipelines: deterministic made-up timings, no machine dependence."""

import itertools

import pytest

from tests.autotune import simulated
from torchpipe.autotune.model import Knob, cpu_cores, memory_bytes, predict_time
from torchpipe.autotune.tuner import CPU_TOLERANCE, Budget, backoff_intervals, hill_climb

KNOBS = [Knob("p", 1, 1, 64), Knob("depth", 1, 1, 256)]


def pipeline(map_s=1e-3, step_s=0.0, cpu=1.0, element=1e5):
    return simulated.pipeline(map_s, step_s, cpu, element)


def best_by_search(stages, budget):
    """The best feasible setting by brute force, for comparison."""
    best = None
    for p, depth in itertools.product(range(1, 33), [1, 2, 4, 8, 16, 32, 64]):
        knobs = {"p": p, "depth": depth}
        if (
            cpu_cores(stages, knobs) > budget.cpu * (1 + CPU_TOLERANCE) + 1e-9
            or memory_bytes(stages, knobs) > budget.ram
        ):
            continue
        t = predict_time(stages, knobs)
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize(
    "stages",
    [
        pipeline(),
        pipeline(cpu=0.05),
        pipeline(step_s=3e-4),
        pipeline(map_s=5e-3, cpu=0.02, step_s=1e-4),
    ],
    ids=["cpu-bound", "io-bound", "consumer-bound", "slow-io"],
)
def test_the_climb_comes_within_5_percent_of_the_best_setting(stages):
    budget = Budget(cpu=2, ram=1e9)
    chosen = hill_climb(stages, KNOBS, budget)
    assert predict_time(stages, chosen) <= 1.05 * best_by_search(stages, budget)
    assert cpu_cores(stages, chosen) <= 2 * (1 + CPU_TOLERANCE) + 1e-9


def test_cpu_bound_work_gets_as_many_workers_as_cores():
    assert (
        hill_climb(pipeline(), KNOBS, Budget(cpu=2, ram=1e9))["p"] == 2
    )  # the rest is 2.5% of the work
    assert hill_climb(pipeline(), KNOBS, Budget(cpu=4, ram=1e9))["p"] == 4


def test_io_bound_work_gets_more_workers_than_cores():
    chosen = hill_climb(pipeline(map_s=5e-3, cpu=0.02), KNOBS, Budget(cpu=2, ram=1e9))
    assert chosen["p"] > 8


def test_a_slower_function_gets_more_parallelism():
    before = hill_climb(pipeline(map_s=1e-3, cpu=0.05, step_s=2e-4), KNOBS, Budget(cpu=2, ram=1e9))
    after = hill_climb(
        pipeline(map_s=5e-3, cpu=0.05, step_s=2e-4),
        [Knob("p", before["p"], 1, 64), Knob("depth", before["depth"], 1, 256)],
        Budget(cpu=2, ram=1e9),
    )
    assert after["p"] >= 4 * before["p"] / 2 and after["p"] > before["p"]


def test_a_ram_budget_is_never_exceeded_by_large_elements():
    big = pipeline(map_s=2e-3, cpu=0.05, element=50e6, step_s=1e-3)
    budget = Budget(cpu=8, ram=300e6)
    chosen = hill_climb(
        big, [Knob("p", 16, 1, 64), Knob("depth", 64, 1, 256)], budget
    )  # starts far over
    assert memory_bytes(big, chosen) <= 300e6
    assert chosen["p"] + chosen["depth"] <= 6


def test_knobs_stay_in_their_ranges():
    stages = pipeline(map_s=1.0, cpu=0.0, step_s=0.1)
    chosen = hill_climb(stages, [Knob("p", 1, 1, 5), Knob("depth", 1, 1, 4)], Budget(2, 1e12))
    assert chosen == {"p": 5, "depth": 4}


def test_budget_defaults_come_from_the_machine():
    budget = Budget.of_machine()
    assert budget.cpu >= 1 and budget.ram > 0
    assert (
        Budget.of_machine(cpu=3, ram=100).cpu == 3 and Budget.of_machine(cpu=3, ram=100).ram == 100
    )


def test_reoptimization_backs_off():
    intervals = list(itertools.islice(backoff_intervals(0.05, 2.0), 20))
    assert intervals[0] == 0.05 and intervals == sorted(intervals) and intervals[-1] == 2.0


def test_a_pools_tasks_in_flight_per_worker_rise_in_powers_of_two_where_the_budget_holds_them():
    """A process pool whose consumer waits on it (a worker's results come in bursts): more tasks in
    flight a worker hide the bursts, each a result's bytes held; the RAM budget caps them."""
    from torchpipe.autotune.model import Stage

    def stages(element):
        calls = Stage(
            "map (calls)",
            2e-3,
            parallelism="p",
            buffer="p",
            per_unit="in_flight",
            bytes_per_element=element,
        )
        return [calls, Stage("consumer", 1e-3)]

    knobs = [Knob("p", 2, 2, 2), Knob("in_flight", 1, 1, 4)]
    chosen = hill_climb(stages(1e6), knobs, Budget(cpu=4, ram=1e9))
    assert chosen["in_flight"] == 4  # 1 -> 2 -> 4: it doubles
    assert predict_time(stages(1e6), chosen) < predict_time(stages(1e6), {"p": 2, "in_flight": 1})
    tight = hill_climb(stages(100e6), knobs, Budget(cpu=4, ram=(2 * 2 + 2) * 100e6))
    # 2 workers x 2 tasks in flight + the 2 calls running fit; x4 does not
    assert tight["in_flight"] == 2

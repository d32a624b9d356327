"""The tuner's rounds on simulated windows (made-up timings), and the tuner thread on a real pipeline."""

import time

import pytest
import torch

import torchpipe as tp
from tests.autotune.simulated import Fake
from torchpipe.autotune import autotuner
from torchpipe.autotune.autotuner import Autotuner, ConsumerClock, Decision
from torchpipe.autotune.live import Model
from torchpipe.autotune.model import Knob, Stage
from torchpipe.autotune.tuner import Budget
from torchpipe.runtime.knob import LiveKnob


def _window(map_s, throughput, step_s=1e-4, cpu=0.05, parallelism=1):
    """A simulated window: an I/O-bound map (``map_s`` a root element) feeding the consumer."""
    stages = [
        Stage("map (calls)", map_s, parallelism="p", buffer="p", cpu_fraction=cpu),
        Stage("consumer", step_s),
    ]
    return Model(stages, [Knob("p", parallelism, 1, 64)], {"p"}, int(throughput), 1.0)


def _tuner():
    applied = []
    knob = LiveKnob("p", 1, 1, 64, False, applied.append, immediate=True)
    return Autotuner(
        Fake("root", knob=knob, role="pool"), ConsumerClock(), Budget(cpu=2, ram=1e9), intervals=[]
    ), knob


def test_rounds_apply_what_the_model_prefers_at_most_doubling_each_knob():
    tuner, knob = _tuner()
    decision = tuner.decide(_window(map_s=2e-3, throughput=500))
    assert knob.value == 2 and decision.values == {"p": 2} and decision.changed == ("p",)
    assert decision.bottleneck == "map (calls)"
    for step in range(4):  # each move pays: the throughput doubles with the parallelism
        tuner.decide(_window(map_s=2e-3, throughput=1000 * 2**step, parallelism=knob.value))
    assert knob.value > 8


def test_a_slower_function_gets_more_parallelism():
    tuner, knob = _tuner()
    for step in range(6):
        tuner.decide(_window(map_s=1e-3, throughput=1000 * 2**step, parallelism=knob.value))
    before = knob.value
    # the move paid: throughput rose
    tuner.decide(_window(map_s=5e-3, throughput=10**6, parallelism=before))
    assert knob.value > before


def test_a_move_that_does_not_pay_is_held_back_for_a_while():
    tuner, knob = _tuner()
    tuner.decide(_window(map_s=2e-3, throughput=500))
    raised = knob.value
    assert raised > 1
    # The next window shows no gain (say the function holds the GIL): back to the old value.
    tuner.decide(_window(map_s=2e-3, throughput=500, parallelism=raised))
    assert knob.value == 1
    for _ in range(7):  # held while the hold lasts, whatever the model says
        tuner.decide(_window(map_s=2e-3, throughput=500))
        assert knob.value == 1
    tuner.decide(_window(map_s=2e-3, throughput=500))
    assert knob.value == 2  # the hold is over: the model may try again


def test_a_move_down_that_loses_throughput_is_undone_and_kept_up_for_a_while():
    tuner, knob = _tuner()
    for step in range(4):
        tuner.decide(_window(map_s=2e-3, throughput=1000 * 2**step, parallelism=knob.value))
    high = knob.value
    # The model thinks a stage above is the limit (a busy CPU inflates its time): it lowers p.
    stages = [
        Stage("map (calls)", 2e-3, parallelism="p", buffer="p", cpu_fraction=0.05),
        Stage("batch", 1e-3),
        Stage("consumer", 1e-4),
    ]
    tuner.decide(Model(stages, [Knob("p", high, 1, 64)], {"p"}, 8000, 1.0))
    assert knob.value < high
    # ...and the next window shows the loss: back up, whatever the model says, for a while.
    for _ in range(8):
        tuner.decide(Model(stages, [Knob("p", knob.value, 1, 64)], {"p"}, 2000, 1.0))
        assert knob.value >= high
    tuner.decide(Model(stages, [Knob("p", knob.value, 1, 64)], {"p"}, 8000, 1.0))
    assert knob.value < high  # the floor is gone: the model may try again


def test_a_round_at_most_halves_a_knob_unless_a_budget_requires_more():
    tuner, knob = _tuner()
    knob.request(16)
    consumer_bound = [
        Stage("map (calls)", 1e-4, parallelism="p", buffer="p", cpu_fraction=0.05),
        Stage("consumer", 1e-2),
    ]
    tuner.decide(Model(consumer_bound, [Knob("p", 16, 1, 64)], {"p"}, 100, 1.0))
    assert knob.value == 8  # the model wants 1: half way there this round
    cpu_bound = [
        Stage("map (calls)", 1e-2, parallelism="p", buffer="p", cpu_fraction=1.0),
        Stage("consumer", 1e-4),
    ]
    tuner.decide(Model(cpu_bound, [Knob("p", 8, 1, 64)], {"p"}, 100, 1.0))
    assert knob.value <= 2  # 8 CPU-bound calls on a 2-core budget: cut at once


def test_a_model_that_cannot_explain_the_window_does_not_lower_knobs():
    tuner, knob = _tuner()
    knob.request(16)
    # Readers of 2 ms a root element, then a 1 ms batch: the model gives 1000/s for any p >= 2.
    stages = [
        Stage("interleave (calls)", 2e-3, parallelism="p", buffer="p", cpu_fraction=0.05),
        Stage("batch", 1e-3),
        Stage("consumer", 1e-4),
    ]
    # The window measured 300/s (an ordered interleave waiting on the inner datasets in its
    # cycle): the model misses what limits the pipeline, so it may not cut the readers.
    tuner.decide(Model(stages, [Knob("p", 16, 1, 64)], {"p"}, 300, 1.0))
    assert knob.value == 16
    # A window it explains (600/s): lowering is the model's to propose again, half way.
    tuner.decide(Model(stages, [Knob("p", 16, 1, 64)], {"p"}, 600, 1.0))
    assert knob.value == 8


def test_a_window_with_new_work_per_element_passes_no_verdict_on_the_last_move():
    tuner, knob = _tuner()
    tuner.decide(_window(map_s=2e-3, throughput=500))
    assert knob.value == 2
    tuner.decide(_window(map_s=10e-3, throughput=300, parallelism=2))  # the function got 5x slower
    assert knob.value > 2  # not held back: the drop came from the work, not from the move


def test_the_consumer_clock_counts_time_outside_next():
    clock = ConsumerClock()
    clock.enter()
    clock.leave()
    time.sleep(0.02)
    assert clock.outside_s() >= 0.02
    clock.enter()
    inside = clock.outside_s()
    time.sleep(0.02)
    assert clock.outside_s() == inside


def _slow(x):
    time.sleep(0.004)
    return x


def test_the_tuner_thread_raises_the_parallelism_of_a_waiting_map_and_keeps_every_element():
    ds = (
        tp.range(100_000)
        .map(_slow, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .prefetch(tp.AUTOTUNE)
    )
    it = iter(ds)
    seen = [next(it)]
    start = it.tuned_values()["map(_slow).parallelism"]  # AUTOTUNE starts at the cores
    seen.extend(next(it) for _ in range(399))
    deadline = time.monotonic() + 20
    while it.tuned_values()["map(_slow).parallelism"] <= start and time.monotonic() < deadline:
        seen.extend(next(it) for _ in range(50))
    assert it.tuned_values()["map(_slow).parallelism"] > start
    seen.extend(next(it) for _ in range(200))
    it.close()
    assert seen == list(range(len(seen)))  # nothing lost, repeated or reordered by the resizes
    assert it.decisions() and it.decisions()[-1].values


def test_the_tuner_thread_starts_when_its_first_round_is_due_so_a_short_pass_starts_none():
    tuner = Autotuner(
        Fake("root"), ConsumerClock(), lambda: Budget(cpu=2, ram=1e9), intervals=[0.05, 60.0]
    )
    tuner.tick()  # the first element: the first window starts, no thread yet
    tuner.tick()
    assert not tuner.started
    time.sleep(0.06)
    tuner.tick()  # the first round is due: the thread starts (and runs it at once)
    assert tuner.started and tuner.budget == Budget(cpu=2, ram=1e9)  # made when first asked for
    tuner.stop()
    ended = Autotuner(Fake("root"), ConsumerClock(), Budget(cpu=2, ram=1e9), intervals=[0.0])
    ended.tick()
    ended.stop()  # the pass ended before its first round: no thread ever
    ended.tick()
    assert not ended.started


def test_disabled_autotune_starts_no_tuner():
    ds = tp.range(50).map(_slow, num_parallel_calls=tp.AUTOTUNE, executor="thread")
    it = iter(ds.with_options(tp.Options(autotune=tp.AutotuneOptions(enabled=False))))
    assert list(it) == list(range(50))
    assert it.decisions() == [] and it.tuned_values() == {}


@pytest.mark.parametrize(
    "field,value,error",
    [
        ("enabled", 1, TypeError),
        ("cpu_budget", 0, ValueError),
        ("ram_budget", "1G", TypeError),
        ("cpu_budget", True, TypeError),
    ],
)
def test_autotune_options_are_checked(field, value, error):
    with pytest.raises(error, match=field):
        tp.AutotuneOptions(**{field: value})
    with pytest.raises(TypeError, match="AutotuneOptions"):
        tp.Options(autotune={"enabled": False})


def _big(x):
    time.sleep(0.004)
    return torch.full((1 << 20,), float(x))  # 4 MB


def test_a_ram_budget_holds_the_buffers_of_large_elements():
    budget = 20 << 20  # five elements
    options = tp.Options(autotune=tp.AutotuneOptions(ram_budget=budget))
    it = iter(tp.range(100_000).map(_big).prefetch(tp.AUTOTUNE).with_options(options))
    deadline = time.monotonic() + 20
    while len(it.decisions()) < 3 and time.monotonic() < deadline:
        next(it)
        time.sleep(0.004)  # a step as long as the producer's: a deeper buffer would pay
    decisions = it.decisions()
    it.close()
    assert decisions
    assert all(d.values["prefetch.buffer_size"] * (4 << 20) <= budget for d in decisions)


@pytest.mark.parametrize("moved", [False, True])
def test_a_window_in_which_a_stage_moved_its_calls_is_not_modelled(monkeypatch, moved):
    """Windows of 10 elements each: the first holds the start-up; the second, if the stage
    moved its calls to another executor in it (two placements in one window), is skipped too."""
    monkeypatch.setattr(autotuner, "_MIN_WINDOW_S", 0.0)
    knob = LiveKnob("p", 0, 0, 4, False, lambda value: None)
    root = Fake("root", knob=knob, role="pool")
    tuner = Autotuner(root, ConsumerClock(), Budget(cpu=2, ram=1e9), intervals=[])
    modelled = []
    tuner.step = lambda before, after: (
        modelled.append(after.produced(root) // 10) or Decision(0, {}, 0, 0, "")
    )

    def windows():
        for window in (1, 2, 3):
            root.stats.produced += 10
            if moved and window == 2:
                knob.moved(2)  # inline to two threads, say
            yield 0.0

    tuner._intervals = windows()
    tuner._run()
    assert modelled == ([3] if moved else [2, 3])
    assert knob.value == (2 if moved else 0) and knob.moves == int(moved)

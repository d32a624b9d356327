"""The model of a running tree, built from made-up counters: no threads, no clocks."""

import dataclasses

import pytest

from tests.autotune.simulated import Fake
from torchpipe.autotune.live import CONSUMER, Counters, Look, build_model
from torchpipe.autotune.model import bottleneck, predict_time
from torchpipe.autotune.tuner import Budget, hill_climb
from torchpipe.runtime.knob import LiveKnob


def _knob(name, value, maximum=16, is_buffer=False):
    return LiveKnob(name, value, 1, maximum, is_buffer, lambda v: None)


def _tree(parallelism=2, maximum=16):
    """source -> map (a pool of 2 processes, AUTOTUNE) -> batch(8) -> prefetch (AUTOTUNE)."""
    source = Fake("source")
    pool = Fake(
        "map",
        source,
        role="pool",
        knob=_knob("map.parallelism", parallelism, maximum),
        parallelism=parallelism,
        slots=4 * parallelism,
        in_processes=True,
    )
    batch = Fake("batch", pool)
    prefetch = Fake(
        "prefetch", batch, role="buffer", knob=_knob("prefetch.buffer_size", 2, 64, True), slots=2
    )
    return prefetch, batch, pool, source


def _looks(prefetch, batch, pool, source, consumer_s):
    """One second in which 10 batches of 8 went through; every map call cost 10 ms of a worker."""
    counters = {
        id(source): Counters(produced=80, wall_s=0.008),
        id(pool): Counters(produced=80, wall_s=0.608, wait_s=0.5, calls=80, work_s=0.8, cpu_s=0.76),
        id(batch): Counters(produced=10, wall_s=0.618),
        id(prefetch): Counters(produced=10, wall_s=0.2, wait_s=0.199, bytes_per_element=1000.0),
    }
    return Look(0.0, {}, 0.0, 0.0), Look(1.0, counters, consumer_s, 0.1)


def test_a_pool_stage_is_its_calls_per_root_element_divided_by_its_parallelism():
    tree = _tree()
    model = build_model(tree[0], *_looks(*tree, consumer_s=0.3))
    by_name = {stage.name: stage for stage in model.stages}
    calls = by_name["map (calls)"]
    assert calls.work_s == pytest.approx(0.8 / 10)  # 8 calls of 10 ms per batch
    assert calls.parallelism == "map.parallelism" and calls.buffer == "map.parallelism"
    assert calls.slots_per_unit == 4 and calls.cpu_fraction == pytest.approx(0.95)
    # The map's own share on the caller's thread excludes its waits and its input.
    assert by_name["map"].work_s == pytest.approx((0.608 - 0.5 - 0.008) / 10)
    assert by_name["batch"].work_s == pytest.approx(0.01 / 10)
    assert by_name["prefetch (producer)"].buffer == "prefetch.buffer_size"
    assert model.stages[-1].name == CONSUMER and model.stages[-1].work_s == pytest.approx(0.03)
    assert model.tunable == {"map.parallelism", "prefetch.buffer_size"}
    assert model.throughput == pytest.approx(10.0)


def test_a_process_maps_tasks_in_flight_knob_gives_its_slots_per_worker():
    source = Fake("source")
    tuned = [_knob("map.parallelism", 2), _knob("map.in_flight", 2, 4, True)]
    pool = Fake("map", source, role="pool", knobs=tuned, parallelism=2, slots=4, in_processes=True)
    prefetch = Fake(
        "prefetch",
        Fake("batch", pool),
        role="buffer",
        knob=_knob("prefetch.buffer_size", 2, 64, True),
        slots=2,
    )
    tree = (prefetch, prefetch.children()[0], pool, source)
    model = build_model(prefetch, *_looks(*tree, consumer_s=0.3))
    calls = {stage.name: stage for stage in model.stages}["map (calls)"]
    assert calls.per_unit == "map.in_flight" and "map.in_flight" in model.tunable


def test_the_map_calls_come_before_the_threads_that_feed_and_drain_them():
    tree = _tree()
    names = [stage.name for stage in build_model(tree[0], *_looks(*tree, consumer_s=0.3)).stages]
    assert names == [
        "map (calls)",
        "source",
        "map",
        "batch",
        "prefetch (producer)",
        "prefetch",
        CONSUMER,
    ]


def test_the_bottleneck_is_the_pool_or_the_consumer_whichever_is_slower():
    tree = _tree()
    slow_pipeline = build_model(tree[0], *_looks(*tree, consumer_s=0.1))
    values = {knob.name: knob.value for knob in slow_pipeline.knobs}
    assert bottleneck(slow_pipeline.stages, values) == "map (calls)"
    # 2 workers, 40 ms a batch
    assert 1 / predict_time(slow_pipeline.stages, values) == pytest.approx(25, rel=0.1)
    slow_consumer = build_model(tree[0], *_looks(*tree, consumer_s=0.9))
    assert bottleneck(slow_consumer.stages, values) == CONSUMER


def test_fixed_values_become_knobs_the_climb_cannot_move():
    source = Fake("source")
    pool = Fake("map", source, role="pool", parallelism=3, slots=3)
    counters = {
        id(source): Counters(produced=9),
        id(pool): Counters(produced=9, calls=9, work_s=0.9),
    }
    model = build_model(pool, Look(0.0, {}, 0.0, 0.0), Look(1.0, counters, 0.0, 0.0))
    (knob,) = model.knobs
    assert knob.minimum == knob.maximum == knob.value == 3 and model.tunable == set()


def test_calls_that_read_ahead_count_the_work_of_the_elements_delivered():
    """An interleave's readers filled their read-ahead: 80 delivered, 400 read, 4 s of reading."""
    tree = _tree()
    prefetch, batch, pool, source = tree
    before, after = _looks(*tree, consumer_s=0.3)
    counters = dict(after.iterators)
    counters[id(pool)] = Counters(
        produced=80, wall_s=0.608, wait_s=0.5, calls=40, work_s=4.0, cpu_s=0.4, items=400
    )
    model = build_model(prefetch, before, Look(1.0, counters, 0.3, 0.1))
    calls = {stage.name: stage for stage in model.stages}["map (calls)"]
    assert calls.work_s == pytest.approx(4.0 * 80 / 400 / 10)  # 10 ms an element read, 8 a batch


def _model_with_calls(tree, pool):
    """The live model of ``tree`` (``_tree()``'s) after a second in which its map's pool counted
    ``pool`` (the source made as many elements, 25 batches of them went out), and its calls' stage."""
    prefetch, batch, mapped, source = tree
    counters = {
        id(source): Counters(produced=pool.produced, wall_s=0.02),
        id(mapped): pool,
        id(batch): Counters(produced=25, wall_s=pool.wall_s + 0.01),
        id(prefetch): Counters(produced=25, wall_s=0.2, wait_s=0.199, bytes_per_element=1000.0),
    }
    model = build_model(prefetch, Look(0.0, {}, 0.0, 0.0), Look(1.0, counters, 0.01, 0.02))
    return model, next(stage for stage in model.stages if stage.name == "map (calls)")


def test_calls_that_wait_for_a_core_count_as_wanting_one_and_no_worker_is_added_past_the_cores():
    """Two workers kept busy on two busy cores: each 10 ms call ran 6 ms and waited 3 for a core.
    By CPU time alone they would seem to wait on I/O 40% of the time, and a third worker to fit."""
    model, calls = _model_with_calls(
        _tree(),
        Counters(
            produced=200, wall_s=0.9, wait_s=0.85, calls=200, work_s=2.0, cpu_s=1.2, delay_s=0.6
        ),
    )
    # it ran 6 ms of the 7 it did not wait for a core: 6 of its 3 ms waited count, 6/7 of 3
    assert calls.cpu_fraction == pytest.approx((1.2 + 0.6 * 1.2 / 1.4) / 2.0)
    assert bottleneck(model.stages, {k.name: k.value for k in model.knobs}) == "map (calls)"
    budget = Budget(cpu=2.0, ram=1e9)
    assert hill_climb(model.stages, model.knobs, budget)["map.parallelism"] == 2
    unwaited = [
        dataclasses.replace(calls, cpu_fraction=0.6) if s is calls else s for s in model.stages
    ]
    assert (
        hill_climb(unwaited, model.knobs, budget)["map.parallelism"] > 2
    )  # what CPU time alone allowed


def test_reads_that_sleep_on_storage_count_only_their_share_of_the_wait_for_a_core():
    """Sixteen reads in flight, each 27 ms of sleeping on storage with 1 ms of parsing; on a busy
    machine each waited 2.75 ms for a core at its wake-ups. Counted whole, that wait made a read
    want 0.14 of a core, and the budget held the reads in flight below 16 where the storage's
    latency wanted more (the cores were half idle); counted in the share the read computes (1 ms
    of the 24.25 it did not wait for a core), the reads may go past 16."""
    model, calls = _model_with_calls(
        _tree(parallelism=16, maximum=64),
        Counters(
            produced=1600, wall_s=0.95, wait_s=0.9, calls=1600, work_s=43.2, cpu_s=1.6, delay_s=4.4
        ),
    )
    assert calls.cpu_fraction == pytest.approx((1.6 + 4.4 * 1.6 / 38.8) / 43.2)
    knobs = model.knobs
    budget = Budget(cpu=2.0, ram=1e9)
    assert hill_climb(model.stages, knobs, budget)["map.parallelism"] > 16
    whole = [
        dataclasses.replace(calls, cpu_fraction=(1.6 + 4.4) / 43.2) if s is calls else s
        for s in model.stages
    ]
    assert hill_climb(whole, knobs, budget)["map.parallelism"] <= 16  # the wait counted whole

"""Knobs turned while a pipeline runs: nothing lost, repeated or reordered, and the sizes change."""

import itertools

import pytest

import torchpipe as tp
from tests.trees import find_stage, stage_stats
from torchpipe.ops.interleave.interleave import InterleaveIterator
from torchpipe.ops.interleave.process_readers import CHUNK_ITEMS, IN_FLIGHT
from torchpipe.ops.interleave.readers import read_ahead_items
from torchpipe.ops.parallel_map import ParallelMapIterator
from torchpipe.ops.prefetch import PrefetchIterator
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.testing import forced_call_costs, move_calls, reader_capacity, ring_slots

NO_TUNER = tp.Options(
    autotune=tp.AutotuneOptions(enabled=False), optimizations={"inject_prefetch": False}
)


def _turn(it, kind, values, every=7, knob_name=""):
    """Consume ``it`` to the end, requesting the next of ``values`` every ``every`` elements from
    the stage's knob whose name ends with ``knob_name`` (its only one by default).

    Returns:
        The elements, the stage's knob and the last value requested.
    """
    out = [next(it)]
    (knob,) = [k for k in find_stage(it, kind).knobs() if k.name.endswith(knob_name)]
    sizes = itertools.cycle(values)
    last = None
    for k, element in enumerate(it):
        out.append(element)
        if k % every == 0:
            last = next(sizes)
            knob.request(last)
    return out, knob, last


def _square(x):
    return x * x


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_parallel_map_resized_while_running_keeps_every_element_in_order(executor):
    ds = (
        tp.range(300)
        .map(_square, num_parallel_calls=tp.AUTOTUNE, executor=executor)
        .with_options(NO_TUNER)
    )
    it = iter(ds)
    out, knob, last = _turn(it, ParallelMapIterator, [1, 4, 2, 3], knob_name=".parallelism")
    assert out == [x * x for x in range(300)]
    assert last == 2  # 43 requests: 1, 4, 2, 3, ..., 2
    assert knob.value == last and find_stage(it, ParallelMapIterator).parallelism() == last


def test_a_process_maps_tasks_in_flight_turned_while_running_keep_every_element_in_order():
    """Each worker process keeps ``in_flight`` tasks (2 to start, as torch's prefetch_factor), each
    a slot of its ring: the autotuner's knob changes both while the map runs."""
    ds = tp.range(300).map(_square, num_parallel_calls=2, executor="process")
    tuned = tp.range(300).map(_square, num_parallel_calls=tp.AUTOTUNE, executor="process")
    fixed = iter(ds.with_options(NO_TUNER))
    next(fixed)
    stage = find_stage(fixed, ParallelMapIterator)
    assert stage.knobs() == [] and stage.buffer_slots() == 2 * 2  # two workers, two tasks each
    fixed.close()
    it = iter(tuned.with_options(NO_TUNER))
    # 1: raised to 2
    out, knob, last = _turn(it, ParallelMapIterator, [4, 1, 2], knob_name=".in_flight")
    assert out == [x * x for x in range(300)]
    stage = find_stage(it, ParallelMapIterator)
    assert knob.value == last == 4  # 43 requests: 4, 1, 2, ..., 4
    assert stage.buffer_slots() == stage.parallelism() * last
    assert [k.name.rsplit(".", 1)[1] for k in stage.knobs()] == ["parallelism", "in_flight"]
    it.close()
    it = iter(
        tp.range(10_000)
        .map(_square, num_parallel_calls=tp.AUTOTUNE, executor="process")
        .with_options(NO_TUNER)
    )
    next(it)
    (knob,) = [
        k for k in find_stage(it, ParallelMapIterator).knobs() if k.name.endswith(".in_flight")
    ]
    for asked, tasks in (
        (4, 4),
        (1, 2),
        (2, 2),
    ):  # never fewer than 2: a worker would wait between tasks
        knob.request(asked)
        for _ in range(100):
            next(it)
        assert set(ring_slots(it)) == {tasks + 1}  # and one the consumer holds
    it.close()


def test_a_map_off_processes_has_no_tasks_in_flight_knob():
    it = iter(
        tp.range(50)
        .map(_square, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .with_options(NO_TUNER)
    )
    next(it)
    assert [k.name for k in find_stage(it, ParallelMapIterator).knobs()] == [
        f"{find_stage(it, ParallelMapIterator).name}.parallelism"
    ]
    it.close()


def test_a_resized_process_pool_has_that_many_workers():
    ds = (
        tp.range(10_000)
        .map(_square, num_parallel_calls=tp.AUTOTUNE, executor="process")
        .with_options(NO_TUNER)
    )
    it = iter(ds)
    next(it)
    knob = find_stage(it, ParallelMapIterator).knobs()[0]
    assert knob.name.endswith(".parallelism")
    knob.request(3)
    next(it)  # applied by the stage itself, between two elements
    mapped = stage_stats(it, "map")
    assert mapped["workers"] == 3 and len(mapped["pids"]) == 3
    knob.request(1)
    for _ in range(50):
        next(it)
    mapped = stage_stats(it, "map")
    assert mapped["workers"] == 1 and len(mapped["pids"]) == 1
    it.close()


def test_a_prefetch_depth_changes_at_once_and_keeps_the_order():
    it = iter(tp.range(500).prefetch(tp.AUTOTUNE).with_options(NO_TUNER))
    out, knob, last = _turn(it, PrefetchIterator, [1, 16, 4, 64], every=11)
    assert out == list(range(500))
    assert knob.value == last == 16  # 46 requests: 1, 16, 4, 64, ..., 16
    assert find_stage(it, PrefetchIterator).depth == last


def _inner(x):
    return tp.range(x * 100, x * 100 + 30)


@pytest.mark.parametrize("executor", ["thread", "process", "auto"])
def test_a_parallel_interleave_resized_while_running_keeps_its_order(executor):
    expected = list(tp.range(40).interleave(_inner, cycle_length=3))
    ds = tp.range(40).interleave(
        _inner, cycle_length=3, num_parallel_calls=tp.AUTOTUNE, executor=executor
    )
    # each resize of a process pool forks or retires workers
    every = 60 if executor == "process" else 7
    out, knob, last = _turn(
        iter(ds.with_options(NO_TUNER)), InterleaveIterator, [1, 8, 2, 5], every=every
    )
    assert out == expected
    assert knob.value == last


def test_requests_are_clamped_to_the_knob_range():
    it = iter(tp.range(5).prefetch(tp.AUTOTUNE).with_options(NO_TUNER))
    next(it)
    (knob,) = find_stage(it, PrefetchIterator).knobs()
    knob.request(10**6)
    assert knob.value == knob.maximum
    knob.request(0)
    assert knob.value == 1
    it.close()


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_readers_read_far_ahead_only_with_four_reads_in_flight_a_slot(executor):
    ds = tp.range(10**6).interleave(
        _inner, cycle_length=2, num_parallel_calls=tp.AUTOTUNE, executor=executor
    )
    it = iter(ds.with_options(NO_TUNER))
    next(it)
    stage = find_stage(it, InterleaveIterator)
    (knob,) = stage.knobs()

    def read_ahead():
        return reader_capacity(it)

    knob.request(3)  # AUTOTUNE starts at the cores: deep already on a machine of 8 or more
    next(it)
    usual = read_ahead()
    # far ahead, a process reader holds that many ready and has its two chunks out besides
    out = IN_FLIGHT * CHUNK_ITEMS if executor == "process" else 0
    for parallelism, deep in [(7, False), (8, True), (3, False)]:
        knob.request(parallelism)
        next(it)
        far = read_ahead_items(stage.stats.bytes_per_element)
        assert far > 2 * usual
        assert read_ahead() == (far + out if deep else usual)
    it.close()


@pytest.mark.parametrize("waits", [False, True])
def test_calls_that_compute_are_tuned_to_one_process_a_core_at_most(waits):
    """A process past the cores holds a worker's memory and cannot make calls that compute any
    faster (``bigtensor``'s DSL was tuned to 4 processes on 2 cores); calls that wait may have
    twice the cores, in a map and in a DataLoader."""
    cores = usable_cpu_count()
    costs = {"cpu_s": 0.002 if waits else 0.01, "moves": False}
    with forced_call_costs(0.01, 0.0, **costs):
        it = iter(
            tp.range(10_000)
            .map(_square, num_parallel_calls=tp.AUTOTUNE, executor="auto")
            .with_options(NO_TUNER)
        )
        next(it)
    move_calls(it, "process", 1)
    (knob,) = [k for k in find_stage(it, ParallelMapIterator).knobs() if k.name.endswith("lism")]
    assert knob.maximum == (2 if waits else 1) * cores
    move_calls(it, "thread", 1)  # threads: as many as calls in flight want
    assert knob.maximum > 2 * cores
    it.close()
    loader = tp.DataLoader(list(range(1000)), batch_size=4, num_workers="auto")
    with forced_call_costs(0.01, 0.0, **costs):
        batches = iter(loader)
    move_calls(batches, "process", 1)
    (knob,) = batches.knobs()
    assert knob.maximum == (2 if waits else 1) * cores
    move_calls(batches, "thread", 1)
    assert knob.maximum == max(loader.num_workers, 2 * cores)
    del batches

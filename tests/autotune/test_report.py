"""``iterator.stats()``: per-stage numbers and the report that names the bottleneck."""

import os
import time

import psutil
import torch

import torchpipe as tp


def _slow(x):
    time.sleep(0.003)
    return x


def _consume(it, count, step_s=0.0):
    for _ in range(count):
        next(it)
        if step_s:
            time.sleep(step_s)


def test_stats_list_every_stage_with_its_numbers():
    ds = (
        tp.range(1000)
        .map(_slow, num_parallel_calls=2, executor="thread")
        .batch(4)
        .prefetch(tp.AUTOTUNE)
    )
    it = iter(ds)
    _consume(it, 20)
    stats = it.stats()
    it.close()
    by_stage = {s["stage"]: s for s in stats}
    assert [s["stage"] for s in stats] == [
        "prefetch",
        "map(_slow)+batch",
        "batch",
        "range",
    ]  # map+batch fused
    assert [s["depth"] for s in stats] == [0, 1, 2, 3]
    mapped = by_stage["map(_slow)+batch"]
    assert mapped["produced"] >= 20 and mapped["throughput"] > 0
    assert 0.012 <= mapped["self_s"] < 0.2  # a call (a batch of 4) on its thread
    assert 0.0 <= mapped["wait_ratio"] <= 1.0 and 0.0 <= mapped["occupancy"] <= 1.0
    assert by_stage["prefetch"]["knobs"] == {
        "prefetch.buffer_size": it.tuned_values()["prefetch.buffer_size"]
    }


def _pid(x):
    return os.getpid()


def _reader(x):
    return tp.range(3).map(lambda y: os.getpid())


def test_stats_say_where_each_stage_runs_and_name_the_worker_processes():
    ds = tp.range(40).map(_pid, num_parallel_calls=2, executor="process").prefetch(2)
    with iter(ds) as it:
        ran_in = set(it)
        prefetch, mapped, source = it.stats()
        children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert prefetch["executor"] == "thread" and "workers" not in source and "executor" not in source
    assert mapped["executor"] == "process" and mapped["workers"] == 2 and len(mapped["pids"]) == 2
    # the calls ran in the processes named
    assert ran_in == set(mapped["pids"]) and ran_in <= children
    with iter(tp.range(40).map(_pid, num_parallel_calls=3, executor="thread")) as it:
        assert set(it) == {os.getpid()}
        (mapped, _) = it.stats()
    assert (mapped["executor"], mapped["workers"]) == ("thread", 3) and "pids" not in mapped

    interleaved = tp.range(6).interleave(
        _reader, cycle_length=2, num_parallel_calls=2, executor="process"
    )
    with iter(interleaved.with_options(tp.Options(optimizations={"inject_prefetch": False}))) as it:
        ran_in = {next(it) for _ in range(6)}
        readers = it.stats()[0]
    assert (
        readers["executor"] == "process"
        and readers["workers"] == 2
        and readers["threads_per_worker"] == 1
    )
    assert ran_in <= set(readers["pids"]) and os.getpid() not in ran_in


def _square(x):
    return x * x


def test_an_auto_map_reports_what_its_policy_measured():
    opts = tp.Options(optimizations={"inject_prefetch": False})
    with iter(tp.range(200).map(_square, num_parallel_calls=tp.AUTOTUNE).with_options(opts)) as it:
        assert list(it) == [x * x for x in range(200)]
        mapped = next(stage for stage in it.stats() if "executor" in stage)
    costs = mapped["policy"]["costs"]
    assert costs["call_s"] > 0 and 0 <= costs["gil_free"] <= 1 and costs["cpu_s"] >= 0
    assert set(mapped["policy"]["measured_s"]) <= {"inline", "thread", "process"}
    with iter(tp.range(4).map(_square, num_parallel_calls=2, executor="thread")) as it:
        list(it)
        # nothing measured
        assert "policy" not in next(stage for stage in it.stats() if "executor" in stage)


def test_the_report_names_a_slow_stage_and_says_the_pipeline_is_the_limit():
    ds = tp.range(1000).map(_slow).batch(4)  # inline: 12 ms a batch on the consumer's side
    it = iter(ds.with_options(tp.Options(optimizations={"inject_prefetch": False})))
    _consume(it, 15)
    stats = it.stats()
    it.close()
    # the map runs fused with its batch, one stage
    assert stats.bottleneck == "map(_slow)+batch" and not stats.consumer_is_limit
    text = str(stats)
    assert "Bottleneck: map(_slow)+batch" in text and "Limit: the pipeline" in text


def test_the_report_says_when_the_training_step_is_the_limit():
    it = iter(tp.range(1000).map(lambda x: torch.tensor(x)).batch(4).prefetch(2))
    _consume(it, 15, step_s=0.01)
    stats = it.stats()
    it.close()
    assert stats.bottleneck == "consumer" and stats.consumer_is_limit and stats.waiting < 0.2
    assert "Limit: the consumer (training step)" in str(stats)


def test_autotuned_pipelines_report_the_tuner_rounds():
    ds = tp.range(100_000).map(_slow, num_parallel_calls=tp.AUTOTUNE, executor="thread")
    it = iter(ds)
    deadline = time.monotonic() + 10
    while not it.decisions() and time.monotonic() < deadline:
        _consume(it, 20)
    text = it.stats().report()
    it.close()
    assert "Autotune:" in text and "map(_slow).parallelism=" in text


def test_stats_before_the_first_element_are_empty():
    it = iter(tp.range(3))
    assert it.stats() == [] and "not started" in str(it.stats())

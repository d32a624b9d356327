"""``iterator.stats()``: per-stage numbers and the report that names the bottleneck."""

import time

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
    ds = tp.range(1000).map(_slow, num_parallel_calls=2, executor="thread").batch(4).prefetch(tp.AUTOTUNE)
    it = iter(ds)
    _consume(it, 20)
    stats = it.stats()
    it.close()
    by_stage = {s["stage"]: s for s in stats}
    assert [s["stage"] for s in stats] == ["prefetch", "map(_slow)+batch", "batch", "range"]  # map+batch fused
    assert [s["depth"] for s in stats] == [0, 1, 2, 3]
    mapped = by_stage["map(_slow)+batch"]
    assert mapped["produced"] >= 20 and mapped["throughput"] > 0
    assert 0.012 <= mapped["self_s"] < 0.2  # a call (a batch of 4) on its thread
    assert 0.0 <= mapped["wait_ratio"] <= 1.0 and 0.0 <= mapped["occupancy"] <= 1.0
    assert by_stage["prefetch"]["knobs"] == {"prefetch.buffer_size": it.tuned_values()["prefetch.buffer_size"]}


def test_the_report_names_a_slow_stage_and_says_the_pipeline_is_the_limit():
    ds = tp.range(1000).map(_slow).batch(4)  # inline: 12 ms a batch on the consumer's side
    it = iter(ds.with_options(tp.Options(optimizations={"inject_prefetch": False})))
    _consume(it, 15)
    stats = it.stats()
    it.close()
    assert stats.bottleneck == "map(_slow)" and not stats.consumer_is_limit
    text = str(stats)
    assert "Bottleneck: map(_slow)" in text and "Limit: the pipeline" in text


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

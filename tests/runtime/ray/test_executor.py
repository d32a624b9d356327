"""executor="ray": map and interleave on Ray actors give what worker processes give, survive killed
actors, resume checkpoints across executors, and size their pool within the cluster's CPUs."""

import functools
import random
import sys
import time

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.runtime.ray.pool import kill_an_actor, running_pools
from torchpipe.testing import assert_checkpoint_roundtrip, assert_exactly_once, assert_same_elements

# One suite worker runs every Ray test (one cluster at a time); a Ray worker imports torch for
# each task, so on two loaded cores a test may take well over a minute: the cap is a hang guard.
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(150)]


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        return {"i": i, "x": torch.full((3,), float(i))}


def draw(row):
    """Every source of randomness a function may use: the global RNGs and tp.rng()."""
    return {
        "i": row["i"],
        "x": row["x"] + torch.rand(3),
        "py": random.random(),
        "np": np.random.rand(),
        "tp": float(tp.rng().random()),
    }


def slow_square(x):
    time.sleep(0.002)
    return x * x


def shard(i):
    return tp.range(i * 10, i * 10 + 10).map(lambda x: (x, random.random()))


def seeded(ds):
    return ds.with_options(tp.Options(seed=7))


def augmented(executor, n=2):
    return seeded(tp.from_dataset(Rows()).shuffle(48).map(draw, n, executor=executor).batch(4))


def interleaved(executor):
    return seeded(
        tp.range(8).interleave(shard, cycle_length=3, num_parallel_calls=2, executor=executor)
    )


# -- options and errors where the mistake is made (no cluster needed) -----------------------------
@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_actors": 0}, ValueError),
        ({"num_actors": 1.5}, TypeError),
        ({"min_actors": 0}, ValueError),
        ({"min_actors": 3, "max_actors": 2}, ValueError),
        ({"num_cpus": -1}, ValueError),
        ({"resources": {"gpu_host": "one"}}, TypeError),
        ({"address": 5}, TypeError),
        ({"tasks_per_actor": 0}, ValueError),
    ],
)
def test_bad_ray_executor_options_fail_at_construction(kwargs, error):
    with pytest.raises(error, match="RayExecutor"):
        tp.RayExecutor(**kwargs)


def test_a_ray_stage_must_say_how_many_calls_run_at_once():
    with pytest.raises(ValueError, match="num_parallel_calls"):
        tp.range(3).map(abs, executor="ray")
    with pytest.raises(ValueError, match="disagree"):
        tp.range(3).map(abs, 2, executor=tp.RayExecutor(num_actors=3))
    with pytest.raises(ValueError, match="executor must be one of"):
        tp.range(3).map(abs, 2, executor="rays")
    assert (
        "num_parallel_calls=3,"
        in tp.range(3).map(abs, executor=tp.RayExecutor(num_actors=3)).explain()
    )


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ImportError, match=r"torchpipe\[ray\]"):
        list(tp.range(3).map(abs, 2, executor="ray"))
    with pytest.raises(ImportError, match=r"torchpipe\[ray\]"):
        tp.from_ray(object())


# -- same output as worker processes -------------------------------------------------------------
def test_a_map_on_ray_gives_what_processes_give(ray_cluster):
    on_ray = list(augmented("ray"))
    assert_same_elements(on_ray, list(augmented("process")))
    assert_same_elements(
        on_ray, list(augmented(tp.RayExecutor(num_actors=1, num_cpus=0.5), n=None))
    )
    assert len(on_ray) == 12 and on_ray[0]["x"].shape == (4, 3)


def test_an_interleave_on_ray_gives_what_processes_give(ray_cluster):
    assert_same_elements(list(interleaved("ray")), list(interleaved("process")))


def test_errors_on_actors_keep_their_type_and_name_the_stage_and_element(ray_cluster):
    def fails_at_5(x):
        if x == 5:
            raise KeyError("five")
        return x

    it = iter(tp.range(10).map(fails_at_5, 2, executor="ray"))
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError, match="five") as raised:
        next(it)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "map(fails_at_5) at element 5" in notes and "Traceback from worker process" in notes


def test_a_function_that_cannot_travel_fails_clearly(ray_cluster):
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="could not be pickled to send it to Ray actors"):
        list(tp.range(3).map(lambda x: (x, lock), 2, executor="ray"))


def test_actors_the_cluster_cannot_place_stall_with_a_clear_error(ray_cluster):
    executor = tp.RayExecutor(resources={"no_such_resource": 1})
    ds = tp.range(3).map(abs, 1, executor=executor).with_options(tp.Options(stall_timeout=1.0))
    with pytest.raises(tp.StallError, match="actors not started or restarting"):
        list(ds)


# -- faults ------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_ray", [False, True], ids=["SIGKILL", "ray.kill"])
def test_nothing_is_lost_or_repeated_when_an_actor_is_killed(ray_cluster, with_ray):
    make = lambda: tp.range(160).map(slow_square, 2, executor="ray")  # noqa: E731
    killed = assert_exactly_once(
        make, seed=3, kill=functools.partial(kill_an_actor, with_ray=with_ray)
    )
    assert killed is not None


def test_a_fused_batch_and_an_interleave_survive_a_killed_actor(ray_cluster):
    make = lambda: tp.range(160).map(slow_square, 2, executor="ray").batch(4)  # noqa: E731
    assert assert_exactly_once(make, seed=1, kill=kill_an_actor) is not None
    make = lambda: tp.range(16).interleave(  # noqa: E731
        lambda i: tp.range(i * 10, i * 10 + 10).map(slow_square),
        cycle_length=4,
        num_parallel_calls=2,
        executor="ray",
    )
    assert assert_exactly_once(make, seed=2, kill=kill_an_actor) is not None


def test_without_restarts_a_dead_actor_is_a_worker_error(ray_cluster):
    ds = (
        tp.range(200)
        .map(slow_square, 2, executor="ray")
        .with_options(tp.Options(restart_workers=False))
    )
    it = iter(ds)
    for _ in range(20):
        next(it)
    pid = kill_an_actor(random.Random(0))
    with pytest.raises(tp.WorkerError, match=f"pid {pid}"):
        list(it)


# -- checkpoints -------------------------------------------------------------------------------
def test_checkpoints_resume_on_ray_and_across_executors(ray_cluster):
    assert_checkpoint_roundtrip(augmented("ray"), positions=[0, 5, 11])
    for first, then in (("ray", "process"), ("process", "ray")):
        for make in (augmented, interleaved):
            expected = list(make(then))
            it = iter(make(first))
            for _ in range(len(expected) // 2):
                next(it)
            resumed = iter(make(then))
            resumed.load_state_dict(it.state_dict())
            assert_same_elements(list(resumed), expected[len(expected) // 2 :])


# -- autotune and stats --------------------------------------------------------------------------
def test_autotune_sizes_the_actor_pool_within_the_clusters_cpus(ray_cluster):
    executor = tp.RayExecutor(num_actors=tp.AUTOTUNE, max_actors=8, num_cpus=0.5)
    it = iter(tp.range(400).map(slow_square, executor=executor))
    out = [next(it) for _ in range(300)]
    assert out == [x * x for x in range(300)]
    ((knob, value),) = it.tuned_values().items()
    held = max(len(pool.actor_processes()) for pool in running_pools())
    # 2 CPUs at 0.5 an actor: never more than 4, whatever the model wants
    assert 1 <= value <= 4 and held <= 4
    stats = it.stats()
    ray = next(stage["ray"] for stage in stats if "ray" in stage)
    assert ray["results"] >= 300 and ray["transfer_s"] > 0 and ray["transfer_bytes_per_s"] > 0
    assert sum(actor["calls"] for actor in ray["actors"].values()) >= 300
    assert "on Ray:" in str(stats) and "Ray actor 0 (pid" in str(stats)

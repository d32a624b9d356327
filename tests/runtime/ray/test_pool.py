"""``RayActorPool`` on its own (``torchpipe/runtime/ray/pool.py``): every task's result once, tasks
spread over the actors, a pool that shrinks while tasks run, one that gives its actors up when
unused and starts again when used. The map and interleave on Ray, killed actors and checkpoints
are tests/runtime/ray/test_executor.py's; what its report counts, test_stats.py's."""

from __future__ import annotations

import time

import pytest

import torchpipe as tp
from torchpipe.runtime.ray.pool import RayActorPool, running_pools

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(150)]
WAIT_S = 90.0


def square(seq, payload):
    time.sleep(0.01)
    return seq, payload * payload


def fails_on_three(seq, payload):
    if payload == 3:
        raise ValueError(f"no square for {payload}")
    return payload * payload


def _results(pool: RayActorPool, count: int) -> dict[int, tuple]:
    """Collect until ``count`` results came (each seq once), within ``WAIT_S``."""
    out: dict[int, tuple] = {}
    deadline = time.monotonic() + WAIT_S
    while len(out) < count:
        assert time.monotonic() < deadline, f"{len(out)} of {count} results"
        for seq, value, error in pool.collect(0.5):
            assert seq not in out, f"result {seq} twice"
            out[seq] = (value, error)
    return out


def _pool(handler, size: int, **options) -> RayActorPool:
    return RayActorPool(handler, size, "test", tp.RayExecutor(num_cpus=0.5, **options))


def test_every_task_gives_one_result_and_the_actors_share_them(ray_cluster):
    pool = _pool(square, 2, tasks_per_actor=1)
    try:
        assert pool.size == 2 and pool.capacity == 2
        # Both actors up first: one still starting when the 24 short tasks are sent may get none
        # of them (the ready one is free again each 10 ms), and "both took tasks" is then luck.
        deadline = time.monotonic() + WAIT_S
        while any(pid is None for _, pid, _ in pool.actor_processes()):
            assert time.monotonic() < deadline, "the actors did not start"
            assert pool.collect(0.2) == []  # installs them; no task was sent
        for seq in range(24):
            pool.submit(seq, seq + 1)
        out = _results(pool, 24)
        assert {seq: value for seq, (value, _) in out.items()} == {
            s: (s, (s + 1) ** 2) for s in range(24)
        }
        report = pool.report()
        calls = [actor["calls"] for actor in report["actors"].values()]
        assert sum(calls) == 24 and len(calls) == 2 and min(calls) > 0  # both took tasks
        assert report["results"] == 24 and report["bytes"] > 0
        assert not any(pool.holds(seq) for seq in range(24))
    finally:
        pool.close()


def test_an_error_comes_back_as_the_tasks_result_and_the_others_go_on(ray_cluster):
    pool = _pool(fails_on_three, 1)
    try:
        for seq in range(5):
            pool.submit(seq, seq)
        out = _results(pool, 5)
        value, error = out[3]
        assert value is None and isinstance(error, ValueError) and "no square for 3" in str(error)
        assert [out[s][0] for s in (0, 1, 2, 4)] == [0, 1, 4, 16]
    finally:
        pool.close()


def test_a_pool_that_shrinks_while_tasks_run_loses_none(ray_cluster):
    pool = _pool(square, 3)
    try:
        for seq in range(30):
            pool.submit(seq, seq)
        first = {seq for seq, _, _ in pool.collect(5.0)}
        pool.resize(1)
        out = _results(pool, 30 - len(first))
        assert first.isdisjoint(out) and first | set(out) == set(range(30))
        deadline = time.monotonic() + WAIT_S
        while len(pool.actor_processes()) > 1:  # the retired ones go once their tasks are done
            assert time.monotonic() < deadline
            pool.collect(0.1)
        with pytest.raises(ValueError, match="pool size must be >= 0"):
            pool.resize(-1)
    finally:
        pool.close()


def test_a_task_no_actor_has_taken_yet_is_in_the_pools_queue(ray_cluster):
    pool = RayActorPool(square, 1, "test", tp.RayExecutor(resources={"no_such_resource": 1}))
    try:
        pool.submit(0, 2)
        assert pool.holds(0) and "the Ray pool's queue (1 of 1 actors not started" in pool.where(0)
        assert pool.collect(0.2) == []
    finally:
        pool.close()


def test_an_unused_pool_gives_its_actors_up_and_starts_again_when_used(ray_cluster):
    pool = _pool(square, 1)
    try:
        pool.submit(0, 3)
        assert _results(pool, 1)[0][0] == (0, 9)
        assert not pool.lapse_if_unused(60.0)  # used just now
        time.sleep(0.2)
        assert pool.lapse_if_unused(0.1) and pool.actor_processes() == []
        assert not pool.lapse_if_unused(0.1)  # once
        pool.submit(1, 4)
        assert _results(pool, 1)[1][0] == (1, 16)
        assert pool in running_pools()
    finally:
        pool.close()

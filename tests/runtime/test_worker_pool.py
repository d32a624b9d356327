"""The worker pools' one contract (``torchpipe/runtime/worker_pool.py``), checked the same way on a
``ProcessPool`` and on a ``RayActorPool`` (on a local Ray cluster of its own, started only for the
Ray cases): every task's result once, errors as results, ``holds``/``where``, preferred slots,
resizing while tasks run, the CPU counted per result, and an idempotent close. What only one pool
does is its own test module's (tests/runtime/processes/test_pool.py, tests/runtime/ray/)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

import torchpipe as tp
from tests.ray_cluster import local_ray_cluster
from torchpipe.runtime.processes.pool import ProcessPool
from torchpipe.runtime.worker_pool import WorkerPool

# one worker runs the module, so its Ray cases share one cluster (up from the first to the last)
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(150)]
WAIT_S = 60.0
METHODS = ("submit", "collect", "resize", "holds", "where", "close", "message_seconds")
"""The contract's methods: an Executor's, and the CPU counted per result."""

ray_cluster = pytest.fixture(scope="module")(local_ray_cluster)


def work(seq, payload):
    """The pid that ran the task, and the payload squared; fails on 'boom', waits on 'nap'."""
    if payload == "boom":
        raise KeyError(f"boom {seq}")
    if payload == "nap":
        time.sleep(0.2)
        return os.getpid(), 0
    return os.getpid(), payload * payload


@pytest.fixture(params=["process", "ray"])
def make_pool(request) -> Iterator:
    """``make_pool(size)``: a started pool of ``size`` workers of the param's kind, closed after."""
    pools: list[WorkerPool] = []

    def make(size: int) -> WorkerPool:
        if request.param == "ray":
            request.getfixturevalue("ray_cluster")
            from torchpipe.runtime.ray.pool import RayActorPool

            pool: WorkerPool = RayActorPool(work, size, "stage", tp.RayExecutor(num_cpus=0.5))
        else:
            pool = ProcessPool(work, size, "stage")
            pool.start()
        pools.append(pool)
        return pool

    try:
        yield make
    finally:
        for pool in pools:
            pool.close()


def collect_all(
    pool: WorkerPool, seqs: set[int], out: dict[int, tuple] | None = None
) -> dict[int, tuple]:
    """Collect into ``out`` until each of ``seqs`` came once, within ``WAIT_S``."""
    out = {} if out is None else out
    deadline = time.monotonic() + WAIT_S
    while len(out) < len(seqs):
        assert time.monotonic() < deadline, f"{len(out)} of {len(seqs)} results"
        collect_once(pool, seqs, out, 0.2)
    return out


def collect_once(pool: WorkerPool, seqs: set[int], out: dict[int, tuple], timeout: float) -> None:
    for seq, value, error in pool.collect(timeout):
        assert seq in seqs and seq not in out, f"result {seq} unasked for or twice"
        out[seq] = (value, error)


def test_both_pools_are_worker_pools_and_executors(make_pool):
    pool = make_pool(2)
    assert isinstance(pool, WorkerPool)
    assert all(callable(getattr(pool, name, None)) for name in METHODS)
    assert pool.size == 2 and pool.capacity >= 2 and pool.name == "stage"
    assert pool.timing.totals() == (0, 0.0, 0.0) and pool.collect(0) == []
    assert pool.message_seconds() is None


def test_every_task_gives_one_result_and_errors_come_back_as_results(make_pool):
    pool = make_pool(2)
    payloads = {seq: "boom" if seq == 3 else seq for seq in range(40)}
    for seq, payload in payloads.items():
        pool.submit(seq, payload)
    assert all(pool.holds(seq) for seq in payloads)
    out = collect_all(pool, set(payloads))
    value, error = out[3]
    assert value is None and isinstance(error, KeyError) and "boom 3" in str(error)
    assert {seq: out[seq][0][1] for seq in payloads if seq != 3} == {
        seq: seq * seq for seq in payloads if seq != 3
    }
    assert not any(pool.holds(seq) for seq in payloads)
    assert pool.message_seconds() is not None and pool.message_seconds() > 0  # 40 results
    assert pool.timing.totals()[0] == 40


def test_where_names_the_worker_running_a_task_and_the_queue_for_one_waiting(make_pool):
    pool = make_pool(1)
    seqs = set(range(pool.capacity + 1))
    for seq in seqs:
        pool.submit(seq, "nap")
    waiting = pool.capacity  # more than the pool takes at once: it waits in the pool's queue
    assert pool.holds(waiting) and "queue" in pool.where(waiting)
    out: dict[int, tuple] = {}
    deadline = time.monotonic() + WAIT_S
    while "queue" in pool.where(0):  # a Ray actor takes tasks once it is up
        assert time.monotonic() < deadline and 0 not in out
        collect_once(pool, seqs, out, 0.05)
    assert pool.where(0).startswith(("worker process ", "Ray actor 0 "))
    collect_all(pool, seqs, out)


def test_tasks_that_prefer_a_slot_run_on_that_slots_worker(make_pool):
    pool = make_pool(2)
    for seq in range(12):
        pool.submit(seq, seq, prefer=seq % 2)
    out = collect_all(pool, set(range(12)))
    pids = [out[seq][0][0] for seq in range(12)]
    assert len(set(pids[0::2])) == 1 and len(set(pids[1::2])) == 1 and pids[0] != pids[1]


def test_shrinking_and_growing_while_tasks_run_loses_and_repeats_none(make_pool):
    pool = make_pool(3)
    for seq in range(30):
        pool.submit(seq, seq)
    pool.resize(1)
    assert pool.size == 1
    for seq in range(30, 45):
        pool.submit(seq, seq)
    pool.resize(2)  # while the retired ones may still finish their tasks
    assert pool.size == 2
    out = collect_all(pool, set(range(45)))
    assert {seq: value[1] for seq, (value, _) in out.items()} == {s: s * s for s in range(45)}
    with pytest.raises(ValueError, match="stage: pool size must be >= 0, got -1"):
        pool.resize(-1)
    assert pool.size == 2


def test_close_is_idempotent_and_forgets_every_task(make_pool):
    pool = make_pool(1)
    pool.submit(0, 2)
    pool.close()
    pool.close()
    assert not pool.holds(0)

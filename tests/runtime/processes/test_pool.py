import os
import signal
import time

import numpy as np
import psutil
import pytest
import torch

from tests.processes import wait_dead
from tests.runtime.codec.alignment import data_addresses, misaligned
from torchpipe.errors import WorkerError
from torchpipe.runtime.codec.columns import to_columns
from torchpipe.runtime.codec.pickling import RAW_MIN
from torchpipe.runtime.processes.pool import PER_WORKER, ProcessPool
from torchpipe.runtime.processes.zygote import Zygote
from torchpipe.testing import assert_elements_equal, worker_rings


def square(seq, x):
    if x == "boom":
        raise KeyError("boom")
    if x == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if x == "big":
        return torch.arange(300_000, dtype=torch.float64)  # 2.4 MB: larger than the ring below
    return {"pid": os.getpid(), "x": torch.tensor([x * x])}


def misaligning(seq, kind):
    """Tensors, arrays and blobs of odd sizes, each of which would misalign the next if packed."""
    g = torch.Generator().manual_seed(seq)
    if kind == "columns":
        return to_columns(
            [(torch.rand(3, generator=g), np.full(5, i, np.int8), i) for i in range(9)]
        )
    element = {
        "blobs": [
            b"\1" * (RAW_MIN + 1),
            "é" * (RAW_MIN + 3),
            bytearray(RAW_MIN + 5),
        ],  # raw buffers too
        "tensors": [
            torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            for n in (0, 1, 3, 63, 65, 1001)
        ],
        "arrays": [np.arange(n, dtype=np.int16) + seq for n in (0, 1, 5, 33)],
        "nested": (
            {"deep": [torch.ones(3, 5, dtype=torch.float64).t() * seq]},
            (np.ones(9, "f4")[::2],),
        ),
        "bits": (
            torch.ones(7, dtype=torch.bfloat16),
            torch.tensor(seq, dtype=torch.int8),
            np.array(seq),
        ),
        "id": f"row-{seq}",
    }
    if kind == "big":
        element["big"] = torch.arange(300_000, dtype=torch.float64)  # 2.4 MB: more than the ring
    return element


def fresh_tensor(shape, dtype):
    return torch.empty(shape, dtype=dtype)


def run_all(pool, payloads, timeout=30, prefer=None):
    pending = dict(enumerate(payloads))
    for seq, payload in pending.items():
        pool.submit(seq, payload, prefer=None if prefer is None else prefer(seq))
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(pending) and time.monotonic() < deadline:
        for seq, value, error in pool.collect(0.2):
            assert seq not in results, f"element {seq} delivered twice"
            results[seq] = (value, error)
    assert len(results) == len(pending)
    return results


def test_results_errors_and_large_results():
    pool = ProcessPool(square, 2, "map(square)")
    pool.start()
    try:
        results = run_all(pool, [1, 2, "boom", 3, "big"])
        assert results[1][0]["x"].item() == 4 and results[3][0]["x"].item() == 9
        assert {results[0][0]["pid"], results[1][0]["pid"]} <= set(pool.pids)
        assert os.getpid() not in pool.pids
        error = results[2][1]
        assert (
            isinstance(error, KeyError) and "Traceback from worker process" in error.__notes__[-1]
        )
        assert torch.equal(results[4][0], torch.arange(300_000, dtype=torch.float64))
    finally:
        pool.close()


def test_resize_grows_and_shrinks():
    pool = ProcessPool(square, 1, "m")
    pool.start()
    try:
        assert pool.capacity == PER_WORKER and len(pool.pids) == 1
        pool.resize(3)
        assert len(pool.pids) == 3
        run_all(pool, list(range(12)))
        old = pool.pids
        pool.resize(1)
        assert len(pool.pids) == 1
        assert wait_dead([p for p in old if p not in pool.pids]) == []
        assert len(run_all(pool, list(range(4)))) == 4
    finally:
        pool.close()


def test_preferred_workers_run_their_tasks_until_their_slot_is_gone():
    pool = ProcessPool(square, 2, "m")
    pool.start()
    try:
        results = run_all(pool, list(range(16)), prefer=lambda seq: seq % 2)
        pids = [results[seq][0]["pid"] for seq in range(16)]
        assert len(set(pids[0::2])) == 1 and len(set(pids[1::2])) == 1 and pids[0] != pids[1]
        pool.resize(1)
        results = run_all(pool, list(range(8)), prefer=lambda seq: 1)  # slot 1 retired: any worker
        assert {value["pid"] for value, _ in results.values()} == set(pool.pids)
    finally:
        pool.close()


def test_killed_worker_is_replaced_and_its_tasks_rerun_exactly_once():
    pool = ProcessPool(square, 2, "m")
    pool.start()
    try:
        victim = pool.pids[0]
        for seq in range(6):
            pool.submit(seq, seq)
        os.kill(victim, signal.SIGKILL)
        results = {}
        for seq in range(6, 12):
            pool.submit(seq, seq)
        deadline = time.monotonic() + 30
        while len(results) < 12 and time.monotonic() < deadline:
            for seq, value, error in pool.collect(0.2):
                assert seq not in results and error is None
                results[seq] = value["x"].item()
        assert results == {s: s * s for s in range(12)}
        assert victim not in pool.pids and len(pool.pids) == 2
    finally:
        pool.close()


def test_without_restarts_a_dead_worker_raises_worker_error():
    pool = ProcessPool(square, 1, "map(square)", restart=False)
    pool.start()
    try:
        pid = pool.pids[0]
        pool.submit(0, "die")
        with pytest.raises(WorkerError, match=f"worker process {pid} killed by SIGKILL") as info:
            for _ in range(100):
                pool.collect(0.2)
        assert info.value.pid == pid and info.value.how == "killed by SIGKILL"
    finally:
        pool.close()


def test_an_element_that_keeps_killing_workers_is_reported():
    pool = ProcessPool(square, 1, "map(square)")
    pool.start()
    try:
        pool.submit(5, "die")
        with pytest.raises(WorkerError, match="element 5 killed 3 worker processes"):
            for _ in range(200):
                pool.collect(0.2)
    finally:
        pool.close()


def _zygote(pool):
    """The pid of the process the pool forks its workers from: their parent."""
    (parent,) = {psutil.Process(pid).ppid() for pid in pool.pids}
    return parent


def test_close_leaves_no_processes():
    pool = ProcessPool(square, 3, "m")
    pool.start()
    pids = [*pool.pids, _zygote(pool)]
    run_all(pool, [1, 2])
    pool.close()
    pool.close()
    assert wait_dead(pids) == []


def test_results_view_shared_memory_until_freed():
    pool = ProcessPool(square, 1, "m")
    pool.start()
    try:
        value = run_all(pool, [3])[0][0]
        ((ring, *_),) = worker_rings(pool)
        assert ring.bytes_in_use() > 0  # lent to the tensor
        value["x"].add_(1)  # writable
        del value
        assert ring.bytes_in_use() == 0
    finally:
        pool.close()


@pytest.mark.parametrize("noticed", [True, False], ids=["reaped", "not_yet_reaped"])
def test_a_killed_zygote_is_replaced_and_nothing_is_lost(monkeypatch, noticed):
    pool = ProcessPool(square, 2, "m")
    pool.start()
    try:
        old = [_zygote(pool), *pool.pids]
        os.kill(old[0], signal.SIGKILL)
        assert wait_dead(old[1:]) == []  # its workers die with it, before the pool has noticed
        if not noticed:  # the moment the zygote is dead but not yet a zombie: it still looks alive
            monkeypatch.setattr(Zygote, "alive", lambda self: True)
        results = run_all(pool, range(8))
        monkeypatch.undo()
        assert {seq: value["x"].item() for seq, (value, _) in results.items()} == {
            s: s * s for s in range(8)
        }
        assert wait_dead(old) == [] and _zygote(pool) not in old
    finally:
        pool.close()


@pytest.mark.parametrize("allocate", [None, fresh_tensor], ids=["views", "allocate"])
def test_every_tensor_and_array_from_a_worker_is_64_byte_aligned(monkeypatch, allocate):
    pool = ProcessPool(misaligning, 1, "m", ring_limit=1 << 20, allocate=allocate)  # segments
    pool.start()
    try:
        kinds = ["small", "big", "columns"] * 3
        results = run_all(pool, kinds)
        (rings,) = worker_rings(pool)
        assert len(rings) == 2  # the ring and its spare
        for seq, kind in enumerate(kinds):
            value, error = results[seq]
            assert error is None
            expected = misaligning(seq, kind)
            if kind == "columns":
                value, expected = value.rows(), expected.rows()
            assert_elements_equal(value, expected)
            assert len(data_addresses(value)) >= 15 and misaligned(value) == []
    finally:
        pool.close()


def test_a_pool_made_not_to_fork_now_forks_its_zygote_with_its_first_worker():
    before = {p.pid for p in psutil.Process().children()}
    pool = ProcessPool(square, 2, "m", fork_now=False)
    try:
        assert {p.pid for p in psutil.Process().children()} == before
        pool.close()  # closing a pool that never forked is fine
        pool = ProcessPool(square, 2, "m", fork_now=False)
        pool.start()
        assert sorted(v["x"].item() for v, _ in run_all(pool, [1, 2, 3]).values()) == [1, 4, 9]
    finally:
        pool.close()


def test_a_released_zygote_goes_and_the_next_workers_fork_a_new_one():
    """A parked pool (no workers) lets its zygote go; asked for workers again it forks another,
    whose workers run tasks as the first ones did. With workers up it is kept."""
    pool = ProcessPool(square, 1, "m")
    pool.start()
    try:
        first = pool.zygote_pid
        assert not pool.release_zygote()  # a worker is up: its zygote stays
        pool.resize(0)
        assert pool.release_zygote() and pool.zygote_pid is None
        assert wait_dead([first]) == [] and pool.process_ids == []
        assert not pool.release_zygote()  # none left
        pool.resize(2)
        second = pool.zygote_pid
        assert second not in (None, first)
        assert {psutil.Process(pid).ppid() for pid in pool.pids} == {second}
        assert sorted(v["x"].item() for v, _ in run_all(pool, [1, 2, 3]).values()) == [1, 4, 9]
    finally:
        pool.close()

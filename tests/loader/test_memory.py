"""A DataLoader's RAM budget (``autotune=tp.AutotuneOptions(ram_budget=...)``, else a share of the
memory available): what the loader holds is read from its processes by a watcher thread; past it,
``num_workers="auto"`` gives up workers, then ring slots, and a count the user chose warns once."""

import mmap
import os
import random
import subprocess
import sys
import threading
import time
import warnings

import psutil
import pytest
import torch

import torchpipe as tp
from tests.runtime.processes.test_output import PAGE, resident
from tests.runtime.processes.test_pool import run_all
from torchpipe.loader import memory as loader_memory
from torchpipe.loader.memory import (
    CHECK_EVERY_S,
    DEFAULT_SHARE,
    MIN_RING_BYTES,
    RELAXED_CHECK_EVERY_S,
    LoaderMemory,
    hold_peak,
    predicted_peak,
    private_bytes,
    release_slot_pages,
    ring_limit,
    workers_fitting,
    workers_within,
)
from torchpipe.runtime.processes.output import slot_bytes
from torchpipe.runtime.processes.pool import ProcessPool
from torchpipe.testing import worker_rings


class Busy(torch.utils.data.Dataset):
    """Items that take CPU and draw from the global RNG (so never on threads): processes pay."""

    def __len__(self):
        return 240

    def __getitem__(self, i):
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        return torch.tensor([i, random.randrange(1000)])


def test_a_process_holds_its_own_pages_and_a_reading_judges_them_against_the_budget():
    assert private_bytes(os.getpid()) > 1 << 20
    assert private_bytes(2**22 + 12345) == 0  # no such process
    memory = LoaderMemory(budget=1.0, given=True)
    assert memory.read([os.getpid()], shared_bytes=0) > 1 << 20 and memory.over
    memory.shed("worker 2 of 2")
    assert not memory.over
    memory.read([os.getpid()], shared_bytes=0)
    assert not memory.over  # a reading right after a shed waits for the shed to take effect
    roomy = LoaderMemory(budget=2**50, given=False)
    roomy.read([os.getpid()], shared_bytes=2**20)
    assert not roomy.over
    report = memory.report()
    assert (
        report["default"] is False
        and report["shed"] == ["worker 2 of 2"]
        and report["peak"] >= report["held"] > 0
    )


def test_the_watcher_reads_on_its_own_thread_until_stopped_or_what_it_watches_is_gone():
    memory = LoaderMemory(budget=2**50, given=False)
    calls = []

    def holdings():
        calls.append(threading.current_thread().name)
        return [os.getpid()], 0.0

    stop = memory.watch(holdings, key=1)
    assert memory.watch(holdings, key=1) is stop  # watching the same thing again keeps the thread
    deadline = time.monotonic() + 10
    while not memory.held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert memory.held > 0 and calls[0] == "torchpipe-loader-memory"
    other = memory.watch(holdings, key=2)  # another pool: the first watcher stops
    assert stop.is_set() and not other.is_set()
    other.set()
    gone = LoaderMemory(budget=1.0, given=True)
    gone.watch(lambda: None, key=3)  # what it watched is gone: the thread ends, no reading
    time.sleep(0.1)
    assert gone.held == 0 and not gone.over


def test_a_loader_still_growing_is_read_often_and_one_steady_far_below_its_budget_seldom():
    memory = LoaderMemory(budget=1000.0, given=True)
    for held, wait in [
        (100, CHECK_EVERY_S),
        (300, CHECK_EVERY_S),
        (310, RELAXED_CHECK_EVERY_S),
        (600, CHECK_EVERY_S),
        (610, CHECK_EVERY_S),
    ]:
        memory.read([], shared_bytes=held)
        # growing; growing; steady; growing; past half the budget
        assert memory.next_reading_in() == wait


def test_past_the_budget_as_many_workers_go_at_once_as_the_reading_says():
    assert workers_within(held=400, budget=390, workers=4) == 3  # a little past: one goes
    # 2.5 workers' shares past: three go
    assert workers_within(held=400, budget=150, workers=4) == 1
    # one is kept (its slots go next, then it)
    assert workers_within(held=400, budget=1, workers=4) == 1


def test_rings_get_half_the_budget_shared_by_the_workers():
    assert ring_limit(256 << 20, 4) == 32 << 20
    assert ring_limit(1, 4) == MIN_RING_BYTES


def test_a_worker_within_a_ring_limit_sends_larger_results_in_segments():
    pool = ProcessPool(lambda seq, n: torch.ones(n), 1, "m", ring_limit=1 << 20, keep_freed=False)
    pool.start()
    try:
        for seq, n in enumerate([10, 1 << 20, 10, 1 << 20]):
            pool.submit(seq, n)
        got = {}
        while len(got) < 4:
            got.update({seq: value for seq, value, _ in pool.collect(0.2)})
        assert [float(got[k].sum()) for k in range(4)] == [10, 1 << 20, 10, 1 << 20]
        assert 0 < pool.ring_bytes <= 1 << 20  # no ring was added for the 4 MB results
    finally:
        pool.close()


def test_a_budget_that_binds_releases_slot_pages_and_one_that_frees_keeps_them_again(monkeypatch):
    """Memory buys workers: past the budget the slots give their pages back once their result is
    released (every worker kept); with room again for all of them, they keep their pages."""
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)
    pool = ProcessPool(lambda seq, n: torch.full((n,), float(seq)), 1, "m", per_worker=2)
    pool.start()
    try:
        n = 1 << 19  # 4 MB results: a ring of 2 slots and a spare of 1
        memory = LoaderMemory(budget=1 << 20, given=True)
        assert all(
            torch.equal(v, torch.full((n,), float(s)))
            for s, (v, _) in run_all(pool, [n] * 6).items()
        )
        memory.read(pool.process_ids, pool.ring_bytes)
        assert memory.over and release_slot_pages(memory, pool) and not pool.slot_pages
        assert not release_slot_pages(memory, pool)  # taken once
        assert (
            memory.report()["slot_pages"] == "released"
            and "1 workers kept" in memory.report()["slot_pages_why"]
        )
        values = run_all(pool, [n] * 3)
        assert all(torch.equal(v, torch.full((n,), float(s))) for s, (v, _) in values.items())
        rings = in_use(pool)
        assert resident(rings) >= 2 * rings[0].slot_bytes  # held: the results' pages
        del values
        # released: given back within ~20 ms
        assert wait_until(lambda: resident(rings) <= 4 * PAGE)
        memory.budget = 1 << 40
        memory.read(pool.process_ids, pool.ring_bytes)
        assert (
            not hold_peak(memory, pool, 1, 4 * n, 0.0)
            and pool.slot_pages
            and memory.slot_pages == "kept"
        )
        values = run_all(pool, [n] * 3)
        assert all(
            torch.equal(v, torch.full((n,), float(s))) for s, (v, _) in values.items()
        )  # read here
        del values
        time.sleep(0.2)  # released: the pages stay
        rings = in_use(pool)
        assert resident(rings) >= 2 * rings[0].slot_bytes
    finally:
        pool.close()


def in_use(pool):
    """The single worker's rings in use: its ring and the spare."""
    return [ring for ring in worker_rings(pool)[0] if not ring.closed]


def test_a_rings_pages_count_once_whether_its_worker_alone_maps_them_or_both_sides_do():
    """A ring's page the worker wrote and this process has not read yet is among the worker's
    private pages: counted with the rings (their resident pages), it is left out of the
    worker's own (a jpeg loader with released slots read 132 MiB where its tree held 90)."""
    # Large beside what else this process may allocate between two readings (the suite's
    # threads): the readings are compared within an eighth of it.
    size, slack = 64 << 20, 8 << 20
    fd = os.memfd_create("test-ring")
    try:
        os.ftruncate(fd, size)
        pages = mmap.mmap(fd, size)
        pages[:] = b"\1" * size  # mapped here alone, as a result the consumer has not read
        whole, apart = private_bytes(os.getpid()), private_bytes(os.getpid(), size)
        assert abs(whole - apart - size) < slack
        reader = subprocess.Popen(  # the consumer maps and reads them: now shared, not private
            [sys.executable, "-c", READ_AND_WAIT.format(fd=fd, size=size)],
            pass_fds=(fd,),
            stdout=subprocess.PIPE,
        )
        try:
            assert reader.stdout is not None and reader.stdout.readline().strip() == b"read"
            whole, apart = private_bytes(os.getpid()), private_bytes(os.getpid(), size)
            assert abs(whole - apart) < slack and whole < apart + size // 2
        finally:
            reader.kill()
            reader.wait()
        pages.close()
    finally:
        os.close(fd)


READ_AND_WAIT = """
import mmap, sys, time
pages = mmap.mmap({fd}, {size})
assert sum(pages[k] for k in range(0, {size}, mmap.PAGESIZE)) == {size} // mmap.PAGESIZE
print("read", flush=True)
time.sleep(60)
"""


def test_a_pool_reads_its_workers_rings_resident_pages_not_their_size():
    """What a loader's budget counts of its rings is the pages they hold (this process holds no
    descriptor of them: ``mincore`` of its mapping), not the slots they may hold."""
    pool = ProcessPool(lambda seq, n: torch.full((n,), float(seq)), 1, "m", per_worker=2)
    pool.start()
    try:
        n = 1 << 19  # 4 MB results: a ring of 2 slots and a spare of 1
        assert len(run_all(pool, [n] * 6)) == 6
        (pid,) = pool.pids
        rings = in_use(pool)
        ring = rings[0]
        assert pool.ring_residency == {pid: resident(rings)}
        assert 2 * ring.slot_bytes <= pool.ring_residency[pid] <= pool.ring_bytes + 4 * PAGE
        pool.set_slot_pages(False)
        values = run_all(pool, [n] * 3)
        del values  # released: their slots' pages given back within ~20 ms
        assert wait_until(lambda: pool.ring_residency[pid] <= 4 * PAGE)
        assert pool.ring_bytes >= 3 * ring.slot_bytes  # the slots are still there
    finally:
        pool.close()


class SlotPool:
    """A pool's slot pages and counts, without processes: what :func:`hold_peak` reads and sets."""

    def __init__(self, size, per_worker=2):
        self.size, self.per_worker, self.threads, self.ring_bytes, self.slot_pages = (
            size,
            per_worker,
            1,
            0,
            True,
        )
        self.zygote_pid = None
        self.switched = []

    def set_slot_pages(self, keep):
        self.slot_pages = keep
        self.switched.append(keep)


def test_a_budget_that_binds_from_the_start_releases_slots_before_the_workers_start(monkeypatch):
    """Budgeted on the peak: before any reading of a worker, the prediction (each worker two
    batches, each slot it may hold resident, the zygote as read) decides; 4 workers with resident
    slots would not fit, with released ones they do, so the slots start released, the workers
    are capped at 4 and the predicted peak stays under it."""
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)
    batch = 10 * 2**20
    slot = slot_bytes(batch)
    memory = LoaderMemory(budget=9 * batch + 9 * slot + 2**20, given=True)
    pool = SlotPool(size=0)
    pool.zygote_pid, memory.alone = 4321, {4321: batch}  # the zygote, read before its first worker
    assert predicted_peak(memory, pool, 4, batch, 0.0, kept=True) == 9 * batch + 12 * slot
    assert workers_fitting(memory, pool, 8, batch, 0.0) == 4
    assert not hold_peak(memory, pool, 4, batch, 0.0)  # fits once released: no worker must go
    assert pool.switched == [False] and memory.report()["slot_pages"] == "released"
    assert "predicted at the peak with 4 workers" in memory.report()["slot_pages_why"]
    assert predicted_peak(memory, pool, 4, batch, 0.0, kept=False) <= memory.budget
    assert hold_peak(memory, pool, 5, batch, 0.0)  # a fifth would not fit even so
    assert not hold_peak(memory, pool, 1, 0.0, 0.0)  # no batch measured: nothing predicted


def test_the_slots_switch_by_the_prediction_both_ways_as_a_budget_binds_then_frees(monkeypatch):
    """A worker read holding more than a batch raises the prediction past the budget (slots
    released); a budget with room within ROOM_SHARE for all of them brings them back; between
    the two, nothing flaps."""
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)
    batch = 2**20
    pool, memory = SlotPool(size=2), LoaderMemory(budget=10 * 2**20, given=True)
    memory.alone = {1234: batch}  # a worker read at a batch of its own
    kept = predicted_peak(memory, pool, 2, batch, 0.0, kept=True)
    assert (
        kept < memory.budget and not hold_peak(memory, pool, 2, batch, 0.0) and pool.switched == []
    )
    memory.alone = {
        1234: 2 * 2**20
    }  # a worker read at 2 MB of its own: resident slots no longer fit
    assert not hold_peak(memory, pool, 2, batch, 0.0) and pool.switched == [False]
    assert not hold_peak(memory, pool, 2, batch, 0.0) and pool.switched == [
        False
    ]  # between: kept as is
    memory.budget = (
        predicted_peak(memory, pool, 2, batch, 0.0, kept=True) / loader_memory.ROOM_SHARE + 1
    )
    assert not hold_peak(memory, pool, 2, batch, 0.0) and pool.switched == [False, True]
    assert (
        memory.report()["slot_pages"] == "kept"
        and "within 80%" in memory.report()["slot_pages_why"]
    )


def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_without_a_ram_budget_the_loader_keeps_to_a_share_of_the_memory_available():
    available = psutil.virtual_memory().available
    loader = tp.DataLoader(Busy(), batch_size=4, num_workers="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # far under it: no warning, nothing shed
        assert len(list(loader)) == 60
    memory = loader.stats()[0]["memory"]
    assert memory["default"] is True and memory["shed"] == []
    assert 0.5 * DEFAULT_SHARE * available < memory["budget"] <= 1.5 * DEFAULT_SHARE * available


def test_the_autotune_argument_is_checked():
    with pytest.raises(TypeError, match="autotune must be a tp.AutotuneOptions"):
        tp.DataLoader(Busy(), num_workers="auto", autotune={"ram_budget": 1})


def test_the_watcher_reads_on_after_a_ring_closes_while_it_is_listed():
    """A worker retiring closes its rings while the watcher lists them: that reading is skipped,
    the next taken (the watcher thread must not die: the budget would go unread)."""
    memory, calls = LoaderMemory(budget=2**50, given=False), []

    def holdings():
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("shm ring is closed")
        return [os.getpid()], 0.0, {}

    stop = memory.watch(holdings, key=5)
    try:
        assert wait_until(lambda: memory.held > 0) and len(calls) >= 2
    finally:
        stop.set()

import os
import signal
import threading
import time

import pytest
import torch

from tests.runtime.processes.test_pool import run_all
from torchpipe.runtime import codec
from torchpipe.runtime.cpu import run_delay
from torchpipe.runtime.processes.output import HELD_MORE, slot_bytes
from torchpipe.runtime.processes.pool import PER_WORKER, ProcessPool


def nap(seq, x):
    """Sleeps ``x`` s (a read of slow storage); says where and when it ran."""
    start = time.monotonic()
    time.sleep(x)
    return os.getpid(), threading.get_ident(), start, time.monotonic(), seq * 10


def counted(seq, x):
    """A short task that reports how many task threads its worker runs."""
    time.sleep(x)
    return seq * seq, threading.get_ident(), threading.active_count() - 1  # less the main thread


def fail_odd(seq, x):
    time.sleep(0.05)
    if seq % 2:
        raise KeyError(f"odd {seq}")
    return seq


def big(seq, x):
    time.sleep(0.05)
    return {
        "thread": threading.get_ident(),
        "x": torch.full((400_000,), float(seq), dtype=torch.float64),
    }  # 3.2 MB


def overlapping(runs):
    """Pairs of ``nap`` results of one process that ran at the same time on different threads."""
    return [
        (a, b)
        for i, a in enumerate(runs)
        for b in runs[i + 1 :]
        if a[0] == b[0] and a[2] < b[3] and b[2] < a[3] and a[1] != b[1]
    ]


def _most_at_once(runs):
    """The most ``nap`` calls each process ran at the same time, by pid."""
    return {
        pid: max(
            sum(r[0] == pid and r[2] <= s[2] < r[3] for r in runs) for s in runs if s[0] == pid
        )
        for pid in {r[0] for r in runs}
    }


def spin_on_one_core(seq, seconds):
    """Computes for ``seconds`` of CPU on the lowest core this process may use (every worker on
    the same one); returns how long that took."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    wall, cpu = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu < seconds:
        pass
    return time.perf_counter() - wall


def collect_all(pool, count, timeout=30):
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        for seq, value, error in pool.collect(0.2):
            assert seq not in results, f"element {seq} delivered twice"
            results[seq] = (value, error)
    assert len(results) == count
    return results


@pytest.mark.parametrize("threads", [4, 1])
def test_one_worker_runs_tasks_at_once_only_when_given_threads(threads):
    pool = ProcessPool(nap, 1, "map(nap)", threads=threads)
    pool.start()
    try:
        results = run_all(pool, [0.2] * 8)
        runs = [results[seq][0] for seq in range(8)]
        assert [run[4] for run in runs] == [seq * 10 for seq in range(8)]
        assert {run[0] for run in runs} == set(pool.pids)
        if threads == 1:
            assert overlapping(runs) == [] and len({run[1] for run in runs}) == 1
        else:
            assert overlapping(runs)
        calls, work_s, cpu_s = pool.timing.totals()
        # each task's own wall time, overlapped or not
        assert calls == 8 and work_s >= 8 * 0.2 * 0.9
        assert cpu_s < work_s / 2  # sleeping costs its thread no CPU
        assert pool.timing.delay_s < work_s / 2  # nor is it a wait for a core
    finally:
        pool.close()


def test_workers_that_share_a_core_report_the_time_they_waited_for_it():
    if run_delay() is None:
        pytest.skip("this kernel reports no run-queue delay")
    pool = ProcessPool(spin_on_one_core, 2, "map(spin)")
    pool.start()
    try:
        walls = [value for value, _ in run_all(pool, [0.15] * 4).values()]
        calls, work_s, cpu_s = pool.timing.totals()
        assert calls == 4 and cpu_s == pytest.approx(0.6, abs=0.1)
        # Two workers computing on one core: each waits for the other about as long as it runs.
        assert pool.timing.delay_s > 0.15
        assert pool.timing.delay_s <= work_s - cpu_s + 0.02
        assert sum(walls) <= work_s
    finally:
        pool.close()


def test_set_threads_up_and_down_while_running():
    pool = ProcessPool(counted, 1, "map(counted)")
    pool.start()
    try:
        results = {}
        for chunk, threads in enumerate([1, 4, 2, 1]):
            pool.set_threads(threads)  # tasks of the chunk before are still in flight or queued
            assert pool.threads == threads
            for seq in range(chunk * 50, chunk * 50 + 50):
                pool.submit(seq, 0.005)
            deadline = time.monotonic() + 30
            while len(results) < chunk * 50 + 25 and time.monotonic() < deadline:
                for seq, value, error in pool.collect(0.2):
                    assert seq not in results and error is None
                    results[seq] = value
        results.update(
            (seq, value) for seq, (value, _) in collect_all(pool, 200 - len(results)).items()
        )
        assert {seq: value[0] for seq, value in results.items()} == {
            seq: seq * seq for seq in range(200)
        }
        assert max(value[2] for value in results.values()) == 4  # the worker started 4 task threads
        deadline = time.monotonic() + 10
        while run_all(pool, [0.0])[0][0][2] != 1:  # surplus threads leave once done
            assert time.monotonic() < deadline, "the worker kept more task threads than asked for"
            time.sleep(0.05)
    finally:
        pool.close()


def test_errors_of_threaded_tasks_keep_their_type():
    pool = ProcessPool(fail_odd, 1, "map(fail_odd)", threads=3)
    pool.start()
    try:
        results = run_all(pool, [None] * 6)
        for seq, (value, error) in results.items():
            if seq % 2:
                assert isinstance(error, KeyError) and f"odd {seq}" in str(error) and value is None
            else:
                assert error is None and value == seq
    finally:
        pool.close()


def test_killed_threaded_worker_is_replaced_with_its_threads():
    pool = ProcessPool(nap, 1, "map(nap)")
    pool.start()
    try:
        (victim,) = pool.pids
        pool.set_threads(4)  # told to the live worker; the replacement must get it at spawn
        for seq in range(12):
            pool.submit(seq, 0.5)
        time.sleep(0.15)  # its first four tasks are running
        os.kill(victim, signal.SIGKILL)
        results = collect_all(pool, 12)
        assert all(error is None for _, error in results.values())
        assert {seq: value[4] for seq, (value, _) in results.items()} == {
            seq: seq * 10 for seq in range(12)
        }
        (replacement,) = pool.pids
        assert replacement != victim
        runs = [value for value, _ in results.values() if value[0] == replacement]
        assert overlapping(runs), "the replacement ran its tasks one at a time"
    finally:
        pool.close()


def test_threads_are_checked_and_raise_the_in_flight_limit():
    with pytest.raises(
        ValueError, match="map\\(nap\\): threads per worker must be an int >= 1, got 0"
    ):
        ProcessPool(nap, 1, "map(nap)", threads=0)
    pool = ProcessPool(nap, 2, "map(nap)", threads=6)
    try:
        assert pool.threads == 6 and pool.capacity == 2 * 6
        with pytest.raises(ValueError, match="map\\(nap\\)"):
            pool.set_threads(0)
        assert pool.threads == 6
        pool.set_threads(2)
        assert pool.threads == 2 and pool.capacity == 2 * PER_WORKER
        pool.start()
        pool.set_threads(PER_WORKER + 2)
        for seq in range(2 * (PER_WORKER + 2) + 3):
            pool.submit(seq, 0.3)
        runs = [value for value, _ in collect_all(pool, 2 * (PER_WORKER + 2) + 3).values()]
        # each worker, no more and no fewer
        assert sorted(_most_at_once(runs).values()) == [PER_WORKER + 2] * 2
    finally:
        pool.close()


def test_large_results_from_several_threads_at_once():
    pool = ProcessPool(big, 1, "map(big)", threads=4)
    pool.start()
    try:
        results = run_all(pool, [None] * 16)  # all held: the ring fills, the rest take segments
        for seq, (value, error) in results.items():
            assert error is None and torch.equal(
                value["x"], torch.full((400_000,), float(seq), dtype=torch.float64)
            )
        assert len({value["thread"] for value, _ in results.values()}) >= 2
        slot = slot_bytes(codec.encode(results[0][0]).nbytes)
        # one ring: 4 in flight and 1 held, and slots it added for results held beyond (all 16 here)
        assert (PER_WORKER + 1) * slot <= pool.ring_bytes <= (PER_WORKER + 1 + HELD_MORE) * slot
    finally:
        pool.close()


class _Arrivals:
    """A handler with ``queued``: each task returns the tasks its worker had seen arrive by then,
    in the order they arrived."""

    def __init__(self):
        self.arrived = []
        self.lock = threading.Lock()

    def queued(self, seq, payload):
        assert threading.current_thread() is threading.main_thread()  # the worker's main thread
        with self.lock:
            self.arrived.append(seq)

    def __call__(self, seq, x):
        time.sleep(x)
        with self.lock:
            return list(self.arrived)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_handler_is_told_of_each_task_as_it_arrives_before_it_runs(threads):
    pool = ProcessPool(_Arrivals(), 1, "interleave(arrivals)", threads=threads)
    pool.start()
    try:
        results = run_all(pool, [0.01] * 12)
    finally:
        pool.close()
    for seq in range(12):
        arrived, error = results[seq]
        assert error is None and seq in arrived  # told before it ran
        assert arrived == sorted(arrived) == list(range(len(arrived)))  # in order

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from torchpipe.runtime import cpu


def test_usable_cpu_count_respects_affinity_and_quota(monkeypatch):
    assert 1 <= cpu.usable_cpu_count() <= (os.cpu_count() or 1)
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: 0.5)
    assert cpu.usable_cpu_count() == 1
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: 1.5)
    assert cpu.usable_cpu_count() == min(2, len(os.sched_getaffinity(0)))


def _switches(conn):
    """In a forked child, its only thread: the voluntary switches of 5 short sleeps, then of 20 ms
    of computing (in the suite's workers, other tests' threads asking for the GIL make a thread
    that computes give it up and wait: 7 switches in one run)."""
    before = cpu.voluntary_switches(os.getpid())
    for _ in range(5):
        time.sleep(0.001)
    slept = cpu.voluntary_switches(os.getpid()) - before
    end = time.thread_time() + 0.02
    while time.thread_time() < end:
        pass
    conn.send((slept, cpu.voluntary_switches(os.getpid()) - before - slept))
    conn.close()


def test_a_process_that_sleeps_switches_voluntarily_and_one_that_computes_does_not():
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_switches, args=(theirs,))
    child.start()
    assert mine.poll(60), "the child did not report"
    slept, computed = mine.recv()
    child.join(10)
    assert slept >= 5 and computed <= 2
    assert cpu.voluntary_switches(2**22 + 12345) == 0  # no such process


def test_run_delay_counts_the_wait_for_a_core_not_the_threads_own_work():
    delay = cpu.run_delay()
    if delay is None:
        pytest.skip("this kernel reports no run-queue delay")
    assert delay >= 0
    seen = []
    thread = threading.Thread(target=lambda: seen.append(cpu.run_delay()))
    thread.start()
    thread.join()
    assert seen[0] is not None and seen[0] >= 0
    native = []
    waiter = threading.Thread(
        target=lambda: (native.append(threading.get_native_id()), time.sleep(0.2))
    )
    waiter.start()
    while not native:
        time.sleep(0.001)
    assert cpu.run_delay(native[0]) is not None  # another thread's, read from here
    waiter.join()
    assert cpu.run_delay(-1) is None  # no such thread
    before = cpu.run_delay()
    time.sleep(0.05)  # sleeping is not waiting for a core
    assert cpu.run_delay() - before < 0.05


def test_run_delay_is_the_time_a_busy_core_kept_this_thread_waiting():
    if cpu.run_delay() is None:
        pytest.skip("this kernel reports no run-queue delay")
    core = min(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile 1: pass"]
    )
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})  # this thread and the hog share one core
        time.sleep(0.2)  # the hog starts spinning
        before, cpu0, t0 = cpu.run_delay(), time.thread_time(), time.perf_counter()
        while time.thread_time() - cpu0 < 0.1:
            pass
        wall, delay = time.perf_counter() - t0, cpu.run_delay() - before
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()
    assert delay > 0.05  # ~half the wall time went to the hog
    assert wall - delay == pytest.approx(0.1, abs=0.05)  # what is left is this thread's own work


def _own_schedstat():
    """The file this thread's cached run-delay descriptor reads, after a read."""
    cpu.run_delay()
    return os.readlink(f"/proc/self/fd/{cpu._OWN_SCHEDSTAT.file.fd}")


def test_run_delay_reads_the_calling_threads_own_counter_in_threads_and_forked_children():
    if cpu.run_delay() is None:
        pytest.skip("this kernel reports no run-queue delay")
    mine = f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"
    assert _own_schedstat() == mine
    read_by_threads = []

    def in_a_thread():
        read_by_threads.append(
            (_own_schedstat(), f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat")
        )

    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join()
    assert all(read == own for read, own in read_by_threads)
    assert len(os.listdir("/proc/self/fd")) <= open_before  # each closed with its thread
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # a forked child inherits the descriptor, which reads the parent's thread
        ok = _own_schedstat() == f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"
        os.write(writer, b"1" if ok else b"0")
        os._exit(0)
    os.close(writer)
    assert os.read(reader, 1) == b"1"
    os.close(reader)
    os.waitpid(child, 0)
    assert _own_schedstat() == mine

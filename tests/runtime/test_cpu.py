import os
import time

from torchpipe.runtime import cpu


def test_usable_cpu_count_respects_affinity_and_quota(monkeypatch):
    assert 1 <= cpu.usable_cpu_count() <= (os.cpu_count() or 1)
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: 0.5)
    assert cpu.usable_cpu_count() == 1
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: 1.5)
    assert cpu.usable_cpu_count() == min(2, len(os.sched_getaffinity(0)))


def test_a_process_that_sleeps_switches_voluntarily_and_one_that_computes_does_not():
    before = cpu.voluntary_switches(os.getpid())
    for _ in range(5):
        time.sleep(0.001)
    slept = cpu.voluntary_switches(os.getpid()) - before
    end = time.thread_time() + 0.02
    while time.thread_time() < end:
        pass
    assert slept >= 5 and cpu.voluntary_switches(os.getpid()) - before - slept <= 2
    assert cpu.voluntary_switches(2**22 + 12345) == 0  # no such process

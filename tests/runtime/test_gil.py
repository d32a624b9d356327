import time

import numpy as np

from torchpipe.runtime.gil import GilProbe


def python_loop():
    total = 0
    for i in range(300_000):
        total += i
    return total


def test_python_code_holds_the_gil_and_sleeping_releases_it():
    with GilProbe() as probe:
        result, held_free, seconds = probe.measure(python_loop)
        _, sleep_free, _ = probe.measure(lambda: time.sleep(0.03))
    assert result == sum(range(300_000)) and seconds > 0
    assert held_free < 0.5 < sleep_free


def test_numpy_work_mostly_releases_the_gil():
    a = np.random.default_rng(0).random((300, 300))
    with GilProbe() as probe:
        _, free, _ = probe.measure(lambda: [a @ a for _ in range(20)])
        _, held, _ = probe.measure(python_loop)
    assert free > held


def test_the_free_rate_is_measured_once_a_process(monkeypatch):
    monkeypatch.setattr(GilProbe, "_calibrated", None)
    GilProbe.calibrate()
    rate = GilProbe._calibrated
    assert rate is not None and rate > 0
    started = []
    monkeypatch.setattr(GilProbe, "__enter__", lambda self: started.append(self) or self)
    GilProbe.calibrate()  # measured already: no probe started
    assert started == [] and GilProbe._calibrated == rate

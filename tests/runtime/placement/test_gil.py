import os
import threading
import time

import numpy as np

from torchpipe.runtime.placement import gil
from torchpipe.runtime.placement.gil import GilProbe
from torchpipe.testing import as_in_a_fresh_process


def counted_calibrations(monkeypatch):
    """The calibrations the probe runs from now on (each sleeps ``CALIBRATE_S``), as a list."""
    sleep, calibrations = time.sleep, []

    def counting_sleep(seconds):
        if seconds == gil.CALIBRATE_S:
            calibrations.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(gil.time, "sleep", counting_sleep)
    return calibrations


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
    # A loaded machine delays the probe's ticks during the sleep too (the scheduler, not the GIL):
    # what must hold is that the sleep lets them run and the loop does not.
    assert held_free < 0.5 and held_free < sleep_free


def test_a_share_counts_whole_only_over_a_window_the_probe_resolves():
    # It resolves a share to one tick: over a window of a few ticks the share counts in
    # proportion, towards held (blobs' single 0.5 ms batch read 0.0-0.77 free), over a window of
    # MIN_TICKS ticks or more it counts whole.
    with GilProbe() as probe:
        assert probe.resolved(0.8, 1.0) == 0.8  # 1 s: thousands of ticks
        assert probe.resolved(0.8, 0.0) == 0.0
        short = probe.resolved(0.8, 0.0005)  # 2-3 ticks at the probe's 0.2 ms
        assert 0.0 < short < 0.8 * 3 / gil.MIN_TICKS + 1e-9
        assert probe.resolved(0.8, 0.0001) < short  # the shorter, the less it counts


def test_numpy_work_mostly_releases_the_gil():
    a = np.random.default_rng(0).random((300, 300))
    with GilProbe() as probe:
        _, free, _ = probe.measure(lambda: [a @ a for _ in range(20)])
        _, held, _ = probe.measure(python_loop)
    assert free > held


def test_the_free_rate_is_measured_once_a_process(monkeypatch):
    calibrations = counted_calibrations(monkeypatch)
    with as_in_a_fresh_process():
        GilProbe.calibrate()
        measured = len(calibrations)
        assert measured > 0
        GilProbe.calibrate()  # measured already
        with GilProbe() as probe:  # a probe started later takes the rate measured
            # long enough for a probe on a busy machine
            _, free, _ = probe.measure(lambda: time.sleep(0.02))
    # a sleep: the GIL free (a busy machine delays the probe)
    assert len(calibrations) == measured and free > 0.3


def test_uncalibrated_is_a_new_process_to_the_probe_and_puts_the_rate_back(monkeypatch):
    """GilProbe.uncalibrated(), the seam of testing.as_in_a_fresh_process: a probe calibrates
    afresh in the block; after it, this process's rate stands again (nothing is measured)."""
    GilProbe.calibrate()
    calibrations = counted_calibrations(monkeypatch)
    with GilProbe.uncalibrated():
        GilProbe.calibrate()
        assert calibrations
    del calibrations[:]
    GilProbe.calibrate()
    with GilProbe():
        pass
    assert calibrations == []


def _probe_threads():
    return [t for t in threading.enumerate() if t.name == "torchpipe-gil-probe"]


def _wake_ups(thread):
    """How many times ``thread`` gave up its core to wait (each tick's sleep is one)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        line = next(line for line in f if line.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def test_probes_share_one_thread_that_ticks_only_while_one_is_open():
    with GilProbe():
        pass
    [thread] = _probe_threads()
    with GilProbe() as first, GilProbe() as second:  # open at once: both see the ticks
        _, free_first, _ = first.measure(lambda: time.sleep(0.02))
        _, free_second, _ = second.measure(lambda: time.sleep(0.02))
    assert free_first > 0 and free_second > 0
    assert _probe_threads() == [thread]  # the same thread, kept
    if not os.path.exists(f"/proc/self/task/{thread.native_id}/status"):
        return  # the OS does not count a thread's waits
    time.sleep(0.005)  # the tick it was sleeping through ends
    before = _wake_ups(thread)
    time.sleep(0.05)  # none open: the thread waits on its event (ticking, it would wake ~250 times)
    assert _wake_ups(thread) - before <= 2


def test_a_forked_child_starts_its_own_probe_thread():
    with GilProbe():
        pass
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a probe must still tick
        try:
            with GilProbe() as probe:
                _, free, _ = probe.measure(lambda: time.sleep(0.02))
            os.write(write, b"1" if free > 0 and len(_probe_threads()) == 1 else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"1"

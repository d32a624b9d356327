import threading
import time

from torchpipe.runtime import timing
from torchpipe.runtime.executor import InlineExecutor, ThreadExecutor


def test_thread_executor_collects_results_and_errors():
    ex = ThreadExecutor(lambda seq, x: 10 // x, 2, "t")
    assert ex.capacity == 2
    for seq, x in enumerate([1, 0, 5]):
        ex.submit(seq, x)
    got = {}
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        for seq, value, error in ex.collect(0.5):
            got[seq] = (value, type(error))
    assert got == {0: (10, type(None)), 1: (None, ZeroDivisionError), 2: (2, type(None))}
    assert ex.collect(0.01) == []
    ex.resize(3)
    assert ex.capacity == 3
    ex.close()


def test_every_call_counts_its_wall_cpu_and_the_time_it_waited_for_a_core(monkeypatch):
    """A pool call's run delay is read on the thread that ran it, before and after: here a
    made-up clock that moves 0.25 s over each call."""
    readings = {}

    def run_delay():
        thread = threading.get_ident()
        readings[thread] = readings.get(thread, -0.25) + 0.25
        return readings[thread]

    monkeypatch.setattr(timing, "run_delay", run_delay)
    inline = InlineExecutor(lambda seq, x: x * 2)
    assert inline.call(0, 4) == 8
    # on the consumer's thread the delay is not read: no model uses it there (two reads a call)
    assert inline.timing.totals()[0] == 1 and inline.timing.delay_s == 0.0 and not readings
    threads = ThreadExecutor(lambda seq, x: x * 2, 2, "t")
    try:
        for seq in range(4):
            threads.submit(seq, seq)
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 4 and time.monotonic() < deadline:
            got.extend(threads.collect(0.5))
        assert threads.timing.totals()[0] == 4 and threads.timing.delay_s == 4 * 0.25
    finally:
        threads.close()
    monkeypatch.setattr(timing, "run_delay", lambda: None)  # where the kernel does not tell
    threads = ThreadExecutor(lambda seq, x: x, 1, "t")
    try:
        threads.submit(0, 0)
        deadline = time.monotonic() + 5
        while not threads.collect(0.5) and time.monotonic() < deadline:
            pass
        assert threads.timing.totals()[0] == 1 and threads.timing.delay_s == 0.0
    finally:
        threads.close()

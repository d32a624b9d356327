"""How calls are clocked and counted: CallTiming's totals, CallClock, sampling cheap calls."""

import time

import pytest

from torchpipe.runtime import timing as timing_module
from torchpipe.runtime.executor import InlineExecutor
from torchpipe.runtime.timing import CallClock, CallTiming, SampledCalls


class _CountedClocks:
    """``time`` as runtime/timing.py reads it, counting the reads of the thread's CPU clock."""

    def __init__(self):
        self.cpu_reads = 0
        self.perf_counter = time.perf_counter

    def thread_time(self):
        self.cpu_reads += 1
        return time.thread_time()


def test_cheap_inline_calls_are_clocked_one_in_a_few_and_all_counted(monkeypatch):
    """#59 item 2: a call on the consumer's thread under SAMPLED_BELOW_S reads the CPU clock one
    call in SAMPLE_EVERY (two reads a clocked call, ~2.5 us), every call is counted, and calls
    that turn dear are clocked from the next one on (a placement must see a cost that changed)."""
    clocks = _CountedClocks()
    monkeypatch.setattr(timing_module, "time", clocks)
    cost = [0.0]

    def call(seq, x):
        if cost[0]:
            time.sleep(cost[0])
        return x

    inline = InlineExecutor(call, CallTiming())
    n = 1600
    assert [inline.call(seq, seq) for seq in range(n)] == list(range(n))
    clocked = clocks.cpu_reads / 2
    assert 1 <= clocked <= 3 * n / timing_module.SAMPLE_EVERY  # ~100 expected, not 1600
    counted = inline.timing.calls
    # exact up to the calls since the last clock
    assert n - 20 * timing_module.SAMPLE_EVERY <= counted <= n
    cost[0] = 2 * timing_module.SAMPLED_BELOW_S
    before = clocks.cpu_reads
    for seq in range(5):
        inline.call(seq, seq)
    # the first dear call ends the gap: the next four are clocked
    assert clocks.cpu_reads - before >= 2 * 4
    assert inline.timing.calls == n + 5
    assert inline.timing.work_s >= 4 * cost[0]


class _Tracer:
    """A CallTracer that records what it is told."""

    def __init__(self):
        self.calls = []

    def call(self, wall_s, start, where, pid):
        self.calls.append((wall_s, start, where, pid))


def test_call_timing_adds_calls_items_and_delays_and_tells_a_trace():
    timing = CallTiming()
    timing.add(0.5, 0.25, calls=2, items=3, delay_s=0.125)
    timing.add_items(4)
    assert timing.totals() == (2, 0.5, 0.25) and timing.items == 7 and timing.delay_s == 0.125
    timing.trace = _Tracer()
    timing.add(1.0, 0.5, start=10.0, where="worker 1", pid=42)
    assert timing.trace.calls == [(1.0, 10.0, "worker 1", 42)] and timing.calls == 3


def test_a_clock_without_its_delay_read_tells_none_and_a_call_counts_once():
    clock = CallClock(delay=False)
    time.sleep(0.01)
    wall_s, cpu_s, delay_s = clock.spent()
    assert wall_s >= 0.01 and cpu_s >= 0.0 and delay_s == 0.0
    timing = CallTiming()
    timing.add_call(CallClock(), items=2)
    calls, work_s, _ = timing.totals()
    assert calls == 1 and work_s >= 0.0 and timing.items == 2 and timing.delay_s >= 0.0


def test_a_sampled_call_that_raises_propagates_and_is_counted():
    timing = CallTiming()
    sampled = SampledCalls(timing)

    def fails(seq, payload):
        raise KeyError(payload)

    with pytest.raises(KeyError):
        sampled.run(fails, 0, "x")
    assert timing.calls == 1  # the first call's CPU clock is read: it is added at once


def test_a_traced_pass_reads_every_call():
    timing = CallTiming()
    timing.trace = _Tracer()
    sampled = SampledCalls(timing)
    assert [sampled.run(lambda seq, x: x + 1, seq, seq) for seq in range(50)] == list(range(1, 51))
    assert timing.calls == 50 and len(timing.trace.calls) == 50


def test_a_call_clock_leaves_out_what_the_call_waited_for_another_call():
    """A process interleave's next chunk waits on its thread for the chunk before: the wait is
    not what the chunk cost, and the task is placed in a trace from when it stopped waiting."""
    import threading

    from torchpipe.runtime.processes.output import _cost

    clock = CallClock()
    timing_module.waited(1000.0)  # more than the call can have taken: only a deduction shows it
    other = threading.Thread(target=timing_module.waited, args=(5000.0,))
    other.start()
    other.join()  # another thread's waits are its calls'
    wall_s, _, _ = clock.spent()
    assert clock.waited_s() == 1000.0 and -1000.0 <= wall_s < 0.0
    assert _cost(clock, None)[0] == clock.wall + 1000.0
    assert CallClock().waited_s() == 0.0

"""How calls are clocked and counted: CallTiming's sampling of cheap calls."""

import time

from torchpipe.runtime import timing as timing_module
from torchpipe.runtime.executor import InlineExecutor
from torchpipe.runtime.timing import CallTiming


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

"""Interleave readers on threads: a read that never returns is caught by the runtime's stall watch."""

from __future__ import annotations

import threading
import time

import pytest

import torchpipe as tp
from torchpipe.core.function import UserFunction
from torchpipe.core.node import BuildContext
from torchpipe.core.stats import IteratorStats
from torchpipe.ops.interleave.readers import InnerOpener
from torchpipe.ops.interleave.thread_readers import ThreadReaders
from torchpipe.runtime.timing import CallTiming


def _reading(fn, name, element, seq, stall_s, wakeup=None):
    """A thread pool of one reader's thread, reading inner dataset ``fn(element)`` as ``seq``."""
    ctx = BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())
    opener = InnerOpener(UserFunction(fn, f"interleave({name})", ctx), ctx)
    pool = ThreadReaders(f"interleave({name})", opener, 1, stall_s=stall_s)
    if wakeup is not None:
        pool.wakeup = wakeup
    stats = IteratorStats()
    stats.calls = CallTiming()
    pool.bind(stats)
    pool.start(1)
    reader = pool.open(element, seq)
    pool.read(reader)
    return pool, reader


def test_a_hung_read_raises_a_stall_error_naming_the_inner_dataset_and_the_thread():
    gate = threading.Event()
    pool, reader = _reading(lambda x: tp.range(2).map(lambda y: gate.wait(10)), "hang", 0, 7, 0.3)
    try:
        named = r"interleave\(hang\): a read of inner dataset 7 .* thread interleave\(hang\)-0"
        with pytest.raises(tp.StallError, match=named) as info:
            pool.take(reader)
        assert (info.value.stage, info.value.seq) == ("interleave(hang)", 7)
    finally:
        gate.set()
        pool.shutdown()


class _CountingCondition:
    """The pool's condition, counting how often the consumer's thread takes it."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.consumer = threading.get_ident()
        self.taken = 0

    def __enter__(self):
        if threading.get_ident() == self.consumer:
            self.taken += 1
        return self._condition.__enter__()

    def __exit__(self, *exc):
        return self._condition.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._condition, name)


def test_the_consumer_takes_what_a_reader_has_ready_at_once_and_hands_it_out_without_the_lock():
    counting = _CountingCondition()
    pool, reader = _reading(tp.range, "range", 100, 0, None, counting)
    try:
        deadline = time.monotonic() + 10
        while reader.held() < pool.capacity and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader reads ahead as far as it may
        assert reader.held() == pool.capacity == 32
        before = counting.taken
        got = [pool.take(reader) for _ in range(32)]
        # the lot at once, a look to read on at half of it: not a lock, or three, an element
        assert counting.taken - before <= 3
        assert reader.taken_state is not None  # the position after what was handed out
        got += [pool.take(reader) for _ in range(68)]
        assert got == [("value", i) for i in range(100)]
        assert reader.place().inner == reader.taken_state
    finally:
        pool.shutdown()

"""Interleave readers on threads: a read that never returns is caught by the runtime's stall watch."""

from __future__ import annotations

import threading

import pytest

import torchpipe as tp
from torchpipe.core.function import UserFunction
from torchpipe.core.node import BuildContext
from torchpipe.core.stats import IteratorStats
from torchpipe.ops.interleave.readers import InnerOpener
from torchpipe.ops.interleave.thread_readers import ThreadReaders
from torchpipe.runtime.timing import CallTiming


def test_a_hung_read_raises_a_stall_error_naming_the_inner_dataset_and_the_thread():
    gate = threading.Event()
    ctx = BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())
    opener = InnerOpener(
        UserFunction(lambda x: tp.range(2).map(lambda y: gate.wait(10)), "interleave(hang)", ctx),
        ctx,
    )
    pool = ThreadReaders("interleave(hang)", opener, 1, stall_s=0.3)
    stats = IteratorStats()
    stats.calls = CallTiming()
    pool.bind(stats)
    pool.start(1)
    reader = pool.open(0, 7)
    pool.read(reader)
    try:
        named = r"interleave\(hang\): a read of inner dataset 7 .* thread interleave\(hang\)-0"
        with pytest.raises(tp.StallError, match=named) as info:
            pool.take(reader)
        assert (info.value.stage, info.value.seq) == ("interleave(hang)", 7)
    finally:
        gate.set()
        pool.shutdown()

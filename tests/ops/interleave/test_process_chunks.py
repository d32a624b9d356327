"""Process readers keep two chunks of a reader out: the second goes on after the first.

A chunk that follows one not yet back reads on from the worker's open inner iterator, waits for the
chunk before it on another thread of the worker, or answers stale and is asked again with the
state; the reader hands its chunks in in order whatever order they come back in, so the elements,
their positions and what a released reader hands over are as with one chunk out.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from typing import Any

import pytest

import torchpipe as tp
from torchpipe.core.function import UserFunction
from torchpipe.core.node import BuildContext
from torchpipe.core.stats import IteratorStats
from torchpipe.ops.interleave import chunk_task, process_readers
from torchpipe.ops.interleave.chunk_task import InnerChunkTask, StaleChunk
from torchpipe.ops.interleave.process_readers import ProcessReaders
from torchpipe.ops.interleave.readers import END, VALUE, InlineReaders, InnerOpener
from torchpipe.runtime.processes.pool import process_executor_supported
from torchpipe.runtime.timing import CallTiming
from torchpipe.testing import assert_checkpoint_roundtrip


def _opener(fn) -> InnerOpener:
    ctx = BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())
    return InnerOpener(UserFunction(fn, "interleave(fn)", ctx), ctx)


def _chunk(chunk: int, follows: bool, state: Any = None, reader: int = 0) -> tuple:
    """A chunk task's payload: 4 items of inner dataset 0 for ``reader``."""
    return (0, 0, None if follows else state, 4, reader, chunk, follows)


def _values(chunk) -> list:
    items = chunk.items() if isinstance(chunk, chunk_task.PackedChunk) else chunk
    return [payload for kind, payload, _ in items if kind == VALUE]


def _state(chunk) -> Any:
    items = chunk.items() if isinstance(chunk, chunk_task.PackedChunk) else chunk
    return [state for kind, _, state in items if kind == VALUE][-1]


def test_a_chunk_that_follows_reads_on_or_is_stale_where_the_iterator_is_not():
    opened = []

    def counted(x):
        opened.append(x)
        return tp.range(20)

    worker = InnerChunkTask(_opener(counted))
    first = worker(0, _chunk(0, False))
    second = worker(1, _chunk(1, True))  # sent before the first came back: no state
    assert _values(first) + _values(second) == list(range(8)) and opened == [0]
    elsewhere = InnerChunkTask(_opener(counted))  # a worker without the iterator
    assert isinstance(elsewhere(2, _chunk(2, True)), StaleChunk)
    assert opened == [0]  # a stale chunk reads nothing
    again = elsewhere(3, _chunk(2, False, _state(second)))  # asked again, with the state
    assert _values(again) == _values(worker(4, _chunk(2, True))) == list(range(8, 12))
    # the end closes the iterator: a chunk that follows it is stale
    rest = elsewhere(5, (0, 0, None, 100, 0, 3, True))
    assert rest[-1][0] == END and isinstance(elsewhere(6, _chunk(4, True)), StaleChunk)


def test_a_chunk_that_follows_waits_for_the_one_before_on_another_thread():
    gate, reading = threading.Event(), threading.Event()

    def held(x):
        def element(y):
            if y == 0:
                reading.set()
                gate.wait(30)
            return y

        return tp.range(20).map(element)

    worker = InnerChunkTask(_opener(held))
    worker.queued(0, _chunk(0, False))  # as a worker's main thread does, as they arrive
    worker.queued(1, _chunk(1, True))
    got: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda c=c, f=f: got.__setitem__(c, worker(c, _chunk(c, f))))
        for c, f in ((0, False), (1, True))
    ]
    threads[0].start()
    assert reading.wait(30)  # chunk 0 holds the iterator on its thread
    threads[1].start()
    threads[1].join(0.5)  # chunk 1 would be answered stale by now if it did not wait
    gate.set()
    for thread in threads:
        thread.join(30)
    assert not isinstance(got[1], StaleChunk)
    both = _values(got[0]) + _values(got[1])  # chunk 0 ends early: its first read was slow
    assert both == list(range(len(both))) and len(_values(got[1])) == 4


class _Scripted:
    """The worker pool played in this process: each worker an :class:`InnerChunkTask` of its own
    (the inner iterators it keeps open are its own). Tasks run when results are collected, in
    the order they were sent, and come back in the reverse order: a reader's later chunk before
    its earlier. With ``restart_every``, every n-th task finds its worker restarted: nothing is
    kept open there, and the tasks queued there arrive again."""

    def __init__(self, task: InnerChunkTask, restart_every: int = 0) -> None:
        self._opener = task.opener
        self._restart_every = restart_every
        self.workers: list[InnerChunkTask] = []
        self.queue: list[tuple[int, Any, int]] = []
        self.size, self.threads, self.pids = 0, 1, []
        self.capacity = 1 << 20
        self.sent = 0
        self.out: Counter[int] = Counter()  # reader -> its chunks out
        self.most_out = 0
        self.results: Counter[str] = Counter()
        self.late = 0  # results that came back before an earlier chunk of their reader
        self.asked: set[tuple[int, int]] = set()  # (reader, chunk) sent
        self.reasked = 0  # chunks asked again with their state

    def set_threads(self, n: int) -> None:
        self.threads = n

    def resize(self, n: int) -> None:
        while len(self.workers) < n:
            self.workers.append(InnerChunkTask(self._opener))
        self.size = n

    def submit(self, seq: int, payload: tuple, prefer: int = 0) -> None:
        worker = prefer % self.size
        self.workers[worker].queued(seq, payload)
        self.queue.append((seq, payload, worker))
        reader, chunk, follows = payload[4:]
        self.reasked += not follows and (reader, chunk) in self.asked
        self.asked.add((reader, chunk))
        self.out[reader] += 1
        self.most_out = max(self.most_out, self.out[reader])

    def collect(self, timeout: float) -> list[tuple[int, Any, BaseException | None]]:
        results = []
        while self.queue:
            seq, payload, worker = self.queue.pop(0)
            self.sent += 1
            if self._restart_every and self.sent % self._restart_every == 0:
                self.workers[worker] = InnerChunkTask(self._opener)
                for _, again, at in [(seq, payload, worker), *self.queue]:
                    if at == worker:
                        self.workers[worker].queued(0, again)
            try:
                result, error = self.workers[worker](seq, payload), None
            except Exception as e:  # noqa: BLE001 - comes back as the task's error
                result, error = None, e
            self.results["stale" if isinstance(result, StaleChunk) else "chunk"] += 1
            self.out[payload[4]] -= 1
            results.append((seq, result, error, payload[4], payload[5]))
        chunks: dict[int, list[int]] = {}
        for _, _, _, reader, chunk in reversed(results):
            self.late += any(chunk < earlier for earlier in chunks.get(reader, []))
            chunks.setdefault(reader, []).append(chunk)
        return [(seq, result, error) for seq, result, error, _, _ in reversed(results)]

    def holds(self, seq: int) -> bool:
        return any(queued == seq for queued, _, _ in self.queue)

    def where(self, seq: int) -> str:
        return "the scripted pool"

    def close(self) -> None:
        self.queue.clear()


def _numbers(x):
    return tp.range(x * 100, x * 100 + 9 + x)


@pytest.mark.parametrize("restart_every", [0, 5])
def test_chunks_back_out_of_order_or_stale_keep_the_order_and_the_positions(
    monkeypatch, restart_every
):
    pools: list[_Scripted] = []

    def scripted(self, task):
        pools.append(_Scripted(task, restart_every))
        return pools[-1]

    monkeypatch.setattr(ProcessReaders, "_make_pool", scripted)
    monkeypatch.setattr(process_readers, "CHUNK_ITEMS", 3)  # several chunks a reader
    kwargs = dict(cycle_length=2, block_length=2)
    ds = tp.range(6).interleave(_numbers, num_parallel_calls=2, executor="process", **kwargs)
    assert list(ds) == list(tp.range(6).interleave(_numbers, **kwargs))
    pool = pools[0]
    assert pool.most_out == 2  # two chunks of a reader out at once
    assert pool.late > 0  # a reader's later chunk came back first
    if restart_every:
        assert pool.results["stale"] > 0 and pool.reasked > 0
    assert_checkpoint_roundtrip(ds, positions=[0, 1, 4, 7, 20, 33, 60, 64])


def test_a_reader_opened_ahead_keeps_one_chunk_out_and_two_once_taken_from(monkeypatch):
    """Readers opened ahead of the cycle's slots fill up one chunk at a time: the workers read
    first for the readers the consumer takes from."""
    pools: list[_Scripted] = []
    monkeypatch.setattr(
        ProcessReaders, "_make_pool", lambda self, task: pools.append(_Scripted(task)) or pools[-1]
    )
    monkeypatch.setattr(process_readers, "CHUNK_ITEMS", 3)
    readers = ProcessReaders("interleave(fn)", _opener(_numbers), 1, restart=True, stall_s=30.0)
    stats = IteratorStats()
    stats.calls = CallTiming()
    readers.bind(stats)
    readers.prepare()
    readers.start(2)
    reader = readers.open(2, 2)
    readers.read(reader)
    assert pools[0].out[reader.id] == 1
    assert readers.take(reader) == (VALUE, 200)
    assert pools[0].out[reader.id] == 2
    readers.shutdown()


def _pool(fn, threads_in_workers: bool, parallelism: int) -> ProcessReaders:
    if not process_executor_supported():
        pytest.skip("worker processes need Linux")
    pool = ProcessReaders(
        "interleave(fn)",
        _opener(fn),
        1,
        restart=True,
        stall_s=30.0,
        threads_in_workers=threads_in_workers,
    )
    stats = IteratorStats()
    stats.calls = CallTiming()
    pool.bind(stats)
    pool.prepare()
    pool.start(parallelism)
    return pool


def _slow(x):
    # slow enough that chunks are out when the worker is killed
    return tp.range(x * 1000, x * 1000 + 120).map(lambda y: time.sleep(0.002) or (y, os.getpid()))


def _rest(x: int, state: Any) -> list:
    """Inner dataset ``x`` from position ``state`` on, read inline."""
    inline = InlineReaders(_opener(_slow))
    reader = inline.open(x, x, state)
    out = []
    while True:
        kind, payload = inline.take(reader)
        if kind == END:
            return out
        out.append(payload[0])


@pytest.mark.parametrize("threads_in_workers", [True, False])
def test_readers_on_worker_threads_survive_a_killed_worker_exactly(monkeypatch, threads_in_workers):
    monkeypatch.setattr(process_readers, "CHUNK_ITEMS", 8)
    pool = _pool(_slow, threads_in_workers, 4)
    try:
        readers = [pool.open(x, x) for x in range(4)]
        for reader in readers:
            pool.read(reader)
        got: dict[int, list] = {x: [] for x in range(4)}
        positions, ended, killed = {}, set(), False
        while len(ended) < 4:
            for x, reader in enumerate(readers):
                if x in ended:
                    continue
                kind, payload = pool.take(reader)
                if kind != VALUE:
                    ended.add(x)
                    continue
                got[x].append(payload[0])
                if len(got[x]) == 30:
                    positions[x] = pool.inner_state(reader)
                if not killed and x == 3 and len(got[x]) == 50:
                    os.kill(payload[1], signal.SIGKILL)  # mid-run, two chunks a reader out
                    killed = True
    finally:
        pool.shutdown()
    assert killed
    assert got == {x: list(range(x * 1000, x * 1000 + 120)) for x in range(4)}
    assert all(_rest(x, positions[x]) == got[x][30:] for x in range(4))

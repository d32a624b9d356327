"""The reader pools behind interleave: one interface, three pools (inline, threads, processes)."""

from __future__ import annotations

import pytest

import torchpipe as tp
from tests.trees import find_stage
from torchpipe.autotune import tunable
from torchpipe.core.function import UserFunction
from torchpipe.core.node import BuildContext
from torchpipe.core.stats import IteratorStats
from torchpipe.ops.interleave.iterator import InterleaveIterator
from torchpipe.ops.interleave.process_readers import ProcessReaders
from torchpipe.ops.interleave.readers import (
    END,
    FAILED,
    VALUE,
    InlineReaders,
    InnerOpener,
    ReaderPlace,
)
from torchpipe.ops.interleave.thread_readers import ThreadReaders
from torchpipe.runtime.processes.pool import process_executor_supported
from torchpipe.runtime.timing import CallTiming


def tens(x: int) -> tp.Dataset:
    if x == 99:
        raise AssertionError("opened an inner dataset whose read-ahead ran to its end")
    return tp.range(x * 10, x * 10 + 5)


def _opener() -> InnerOpener:
    ctx = BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())
    return InnerOpener(UserFunction(tens, "interleave(tens)", ctx), ctx)


def _pool(kind: str):
    """A started pool of ``kind``, counting into fresh stats."""
    if kind == "inline":
        pool = InlineReaders(_opener())
    elif kind == "thread":
        pool = ThreadReaders("interleave(tens)", _opener(), 1, stall_s=10.0)
    else:
        if not process_executor_supported():
            pytest.skip("worker processes need Linux")
        pool = ProcessReaders("interleave(tens)", _opener(), 1, restart=True, stall_s=10.0)
    stats = IteratorStats()
    stats.calls = CallTiming()
    pool.bind(stats)
    pool.prepare()
    pool.start(2)
    return pool


def _drain(pool, reader) -> list:
    """Every ``(kind, payload)`` of ``reader`` up to its end, each with the inner state after it."""
    pool.read(reader)
    out = []
    while True:
        kind, payload = pool.take(reader)
        out.append((kind, payload, pool.inner_state(reader) if kind == VALUE else None))
        if kind in (END, FAILED):
            return out


def _states_of_inline_reads(element: int) -> list:
    pool = _pool("inline")
    return _drain(pool, pool.open(element, 0))


KINDS = ["inline", "thread", "process"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_reader_opens_at_a_saved_place_and_gives_what_was_read_ahead_first(kind):
    items = _states_of_inline_reads(1)  # 10..14, each with the state after it, then the end
    assert [payload for _, payload, _ in items] == [10, 11, 12, 13, 14, None]
    # Taken: 10; read ahead (by another pool): 11 and 12; this pool goes on from there.
    place = ReaderPlace(1, 0, items[0][2], None, tuple(items[1:3]))
    pool = _pool(kind)
    try:
        got = _drain(pool, pool.open(*place))
    finally:
        pool.shutdown()
    assert [(k, p) for k, p, _ in got] == [(k, p) for k, p, _ in items[1:]]
    # Each element's position (a state a chunk, and the items read after it) reads on as the inline one does.
    assert [_rest_from(state) for _, _, state in got[:-1]] == [
        _rest_from(state) for _, _, state in items[1:-1]
    ]


def _rest_from(state) -> list:
    """The elements of inner dataset ``tens(1)`` from position ``state`` on."""
    pool = _pool("inline")
    return [payload for _, payload, _ in _drain(pool, pool.open(1, 0, state))]


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_reader_takes_the_inner_state_once_a_chunk(kind, monkeypatch):
    from torchpipe.ops.source_nodes import IndexedSourceIterator

    taken = []
    real = IndexedSourceIterator.get_state
    monkeypatch.setattr(
        IndexedSourceIterator, "get_state", lambda self: taken.append(1) or real(self)
    )
    pool = _pool(kind)
    try:
        items = _drain(pool, pool.open(1, 0))
    finally:
        pool.shutdown()
    assert [p for _, p, _ in items] == [10, 11, 12, 13, 14, None]
    if kind == "thread":  # a worker process's reads are counted there
        assert len(taken) <= 2
    assert [_rest_from(state) for _, _, state in items[:-1]] == [
        [11, 12, 13, 14, None],
        [12, 13, 14, None],
        [13, 14, None],
        [14, None],
        [None],
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_reader_whose_read_ahead_ran_to_the_end_opens_nothing(kind):
    place = ReaderPlace(
        99, 0, {"stands": "for a state"}, None, ((VALUE, 990, {"after": 990}), (END, None, None))
    )
    pool = _pool(kind)
    try:
        reader = pool.open(*place)
        pool.read(reader)
        assert pool.take(reader) == (VALUE, 990) and pool.inner_state(reader) == {"after": 990}
        assert pool.take(reader) == (END, None)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_reader_for_a_failed_input_element_only_fails(kind):
    pool = _pool(kind)
    try:
        reader = pool.open(None, 3, None, KeyError("no such file"))
        pool.read(reader)
        kind_, error = pool.take(reader)
    finally:
        pool.shutdown()
    assert kind_ == FAILED and isinstance(error, KeyError)


@pytest.mark.parametrize("kind", KINDS)
def test_released_readers_hand_over_their_place_and_what_they_read(kind):
    pool = _pool(kind)
    try:
        reader = pool.open(2, 0)
        pool.read(reader)
        assert pool.take(reader) == (VALUE, 20)
        if kind != "inline":  # it reads ahead: wait until it has
            pool.wait(lambda: pool.has_ready(reader))
        (place,) = pool.release([reader])
    finally:
        pool.shutdown()
    assert (place.element, place.seq) == (2, 0)
    resumed = _pool("inline")
    assert [p for _, p, _ in _drain(resumed, resumed.open(*place))] == [21, 22, 23, 24, None]


def test_the_inline_pool_runs_through_the_same_iterator():
    it = iter(tp.range(3).flat_map(tens))
    assert next(it) == 0
    stage = find_stage(it, InterleaveIterator)
    assert stage.executor_kind == "inline" and stage.parallelism() == 0
    assert tunable.role(stage) is None  # the autotuner sees it as an op on its caller's thread
    assert len(stage.children()) == 2  # its input, and the inner dataset it reads
    assert list(it) == [1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24]

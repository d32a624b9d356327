import gc
import threading
import time

import pytest
import torch

import torchpipe as tp
from tests.trees import find_stage, stage_stats
from torchpipe.ops.parallel_map import ParallelMapIterator
from torchpipe.ops.prefetch import AUTOTUNE_DEPTH, OverlapChoice, PrefetchIterator
from torchpipe.runtime.placement.costs import INLINE, THREAD
from torchpipe.testing import (
    assert_checkpoint_roundtrip,
    assert_same_elements,
    forced_call_costs,
    knobs,
    leave_prefetch_in,
    ring_slots,
    stages,
    worker_rings,
)

NO_INJECT = tp.Options(optimizations={"inject_prefetch": False})


def _prefetch_threads(before):
    return [
        t
        for t in threading.enumerate()
        if t not in before and t.name.startswith("torchpipe-prefetch")
    ]


def _fails_on(bad):
    def check(x):
        if x in bad:
            raise ValueError(f"bad {x}")
        return x

    return check


@pytest.mark.parametrize("buffer_size", [1, 2, 7, tp.AUTOTUNE])
def test_same_values_and_order_as_without_prefetch(buffer_size):
    base = tp.range(30).map(lambda x: {"x": x, "sq": x * x})
    assert_same_elements(base.prefetch(buffer_size), base)
    assert list(tp.range(0).prefetch(buffer_size)) == []


def test_zero_is_a_passthrough():
    before = set(threading.enumerate())
    it = iter(
        tp.range(5).prefetch(0).with_options(tp.Options(optimizations={"inject_prefetch": False}))
    )
    assert next(it) == 0
    assert [s["stage"] for s in it.stats()] == ["range"] and not _prefetch_threads(before)
    assert list(it) == [1, 2, 3, 4]


def test_autotune_uses_a_resizable_default_depth():
    it = iter(tp.range(50).prefetch(tp.AUTOTUNE))
    assert next(it) == 0
    tree = stages(it)[0]
    assert isinstance(tree, PrefetchIterator) and tree.depth == AUTOTUNE_DEPTH
    tree.depth = 5  # what the autotuner does while the pipeline runs
    assert tree.buffer.depth == 5
    assert list(it) == list(range(1, 50))


def _depth(it):
    """The prefetch buffer's depth, as the pass's stats report it."""
    return it.stats()[0]["knobs"]["prefetch.buffer_size"]


def test_the_next_pass_starts_at_the_depth_the_tuner_left():
    ds = (
        tp.range(50)
        .prefetch(tp.AUTOTUNE)
        .with_options(tp.Options(autotune=tp.AutotuneOptions(enabled=False)))
    )
    first = iter(ds)
    next(first)
    knobs(first)[0].request(8)  # what the autotuner's request does (applied at once)
    assert _depth(first) == 8 and list(first) == list(range(1, 50))
    second = iter(ds)
    assert next(second) == 0 and _depth(second) == 8
    fresh = iter(tp.range(50).prefetch(tp.AUTOTUNE))  # another Dataset starts from the default
    assert next(fresh) == 0 and _depth(fresh) == AUTOTUNE_DEPTH


def test_runs_ahead_on_a_thread_up_to_the_buffer_size():
    pulled = []
    ready = threading.Event()

    def record(x):
        pulled.append(x)
        if len(pulled) >= 4:
            ready.set()
        return x

    with iter(tp.range(100).map(record).prefetch(3)) as it:
        assert next(it) == 0
        assert ready.wait(10)  # element 0 delivered, then 3 more buffered
        time.sleep(0.1)
        assert pulled == [0, 1, 2, 3]


def test_errors_arrive_in_position_and_iteration_continues():
    it = iter(tp.range(6).map(_fails_on({2, 3})).prefetch(2))
    out = []
    while True:
        try:
            out.append(next(it))
        except StopIteration:
            break
        except ValueError as e:
            out.append(str(e))
    # verified against tf.data 2.21: the error takes its place, then the rest follows
    assert out == [0, 1, "bad 2", "bad 3", 4, 5]
    assert next(it, "end") == "end"


def test_errors_keep_their_type_and_note():
    with pytest.raises(KeyError) as info:
        list(tp.range(3).map(lambda x: {}[x]).prefetch(1))
    assert any("map(<lambda>)" in note for note in info.value.__notes__)


def test_ignore_errors_downstream():
    # verified against tf.data 2.21: [0, 1, 3, 4]
    assert list(tp.range(5).map(_fails_on({2})).prefetch(2).ignore_errors()) == [0, 1, 3, 4]


def test_cardinality_and_explain():
    assert tp.range(7).prefetch(2).cardinality() == 7
    assert tp.range(7).repeat().prefetch(2).cardinality() == tp.INFINITE
    assert "prefetch(buffer_size=AUTOTUNE)" in tp.range(3).prefetch(tp.AUTOTUNE).explain()
    assert "prefetch(buffer_size=4)" in tp.range(3).prefetch(4).explain()


def test_close_mid_stream_with_slow_upstream_stops_the_thread():
    def slow(x):
        time.sleep(0.05)
        return x

    before = set(threading.enumerate())
    it = iter(tp.range(1000).map(slow).prefetch(4))
    assert next(it) == 0
    threads = _prefetch_threads(before)
    assert len(threads) == 1
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 1.5
    assert not threads[0].is_alive()


def test_abandoned_iterator_stops_its_thread():
    before = set(threading.enumerate())
    it = iter(tp.range(10_000).prefetch(2))
    next(it)
    threads = _prefetch_threads(before)
    assert len(threads) == 1
    del it
    gc.collect()
    threads[0].join(5)
    assert not threads[0].is_alive()


def test_each_repetition_stops_its_thread():
    before = set(threading.enumerate())
    assert list(tp.range(3).prefetch(2).repeat(4)) == [0, 1, 2] * 4
    for thread in _prefetch_threads(before):
        thread.join(5)
        assert not thread.is_alive()


@pytest.mark.parametrize("buffer_size", [1, 2, tp.AUTOTUNE])
def test_checkpoint_roundtrip(buffer_size):
    assert_checkpoint_roundtrip(tp.range(12).map(lambda x: x * 3).prefetch(buffer_size))
    assert_checkpoint_roundtrip(tp.range(5).map(lambda x: x + 1).prefetch(buffer_size).repeat(2))
    assert_checkpoint_roundtrip(tp.range(5).map(lambda x: x + 1).repeat(2).prefetch(buffer_size))


def test_checkpoint_roundtrip_under_shuffle_and_batch():
    ds = tp.range(20).map(lambda x: x * x).prefetch(3).shuffle(6, seed=4).batch(3).prefetch(1)
    assert_checkpoint_roundtrip(ds)


def test_checkpoint_with_errors_in_the_stream():
    ds = tp.range(8).map(_fails_on({1, 5})).prefetch(2).ignore_errors()
    assert assert_checkpoint_roundtrip(ds) == [0, 2, 3, 4, 6, 7]


def test_checkpoint_does_not_include_buffered_elements():
    ds = tp.range(100).map(lambda x: x).prefetch(10)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.state_dict()
    it.close()
    # the input's position before the first undelivered element, not the buffer's contents
    assert state["pipeline"]["input"] == {"index": 3}
    with iter(ds) as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == list(range(3, 100))


def _waiting(x):
    time.sleep(0.001)  # the GIL is free while it waits: a thread overlaps it with the consumer
    return x


def _executor(it):
    """Where the prefetch runs its input, as the stats say: ``thread`` or ``inline``."""
    return stage_stats(it, "prefetch")["executor"]


def test_autotune_runs_the_input_inline_for_a_consumer_with_nothing_to_overlap():
    it = iter(tp.range(10**6).prefetch(tp.AUTOTUNE).with_options(NO_INJECT))
    # a loop that only collects: a hand-off costs more than an element. On a loaded machine
    # the consumer, descheduled, may look busy for a window and the thread get a trial: what
    # must hold is that the input ends up inline, every element in its place.
    got = [next(it) for _ in range(20_000)]
    deadline = time.monotonic() + 20
    while _executor(it) != "inline":
        got.append(next(it))
        assert time.monotonic() < deadline
    assert got == list(range(len(got)))
    state = it.state_dict()
    rest = [next(it) for _ in range(10)]
    again = iter(tp.range(10**6).prefetch(tp.AUTOTUNE).with_options(NO_INJECT))
    again.load_state_dict(state)
    assert [next(again) for _ in range(10)] == rest == list(range(len(got), len(got) + 10))


def test_autotune_keeps_the_thread_where_it_overlaps_and_comes_back_to_it():
    it = iter(tp.range(10**6).map(_waiting).prefetch(tp.AUTOTUNE).with_options(NO_INJECT))
    got = [next(it)]
    deadline = time.monotonic() + 20
    while _executor(it) != "inline" or len(got) < 200:  # an idle consumer first: inline
        got.append(next(it))
        assert time.monotonic() < deadline
    # then one that works as long as an element takes: the thread again
    while _executor(it) != "thread":
        got.append(next(it))
        time.sleep(0.001)
        assert time.monotonic() < deadline
    for _ in range(300):
        got.append(next(it))
        time.sleep(0.001)
    assert _executor(it) == "thread" and got == list(range(len(got)))


def test_an_explicit_buffer_keeps_its_thread():
    it = iter(tp.range(10**6).prefetch(2).with_options(NO_INJECT))
    assert [next(it) for _ in range(20_000)] == list(range(20_000)) and _executor(it) == "thread"


def test_passes_shorter_than_a_window_are_judged_at_their_end_and_the_next_goes_on_from_there():
    """Epochs of a few ms: a window never lasts its 0.1 s, so each pass's end closes one; the
    choice lives with the pipeline from one pass to the next, as its depth does."""
    choice = OverlapChoice(THREAD)
    now = 0.0
    for _ in range(20):  # 1 ms an element on the thread; pulling one inline costs 0.3 ms
        now += 1e-3
        assert choice.delivered(now, 0.0, lambda: 0.3e-3) == THREAD
    assert choice.delivered(now, 0.0, lambda: 0.3e-3, last=True) == INLINE
    choice.new_pass()
    assert choice.mode == INLINE  # the next pass starts inline

    pipeline = tp.range(64).prefetch(tp.AUTOTUNE).with_options(NO_INJECT)
    for passes in range(1, 11):
        it = iter(pipeline)
        assert list(it) == list(range(64))  # a pass of well under a window
        if passes >= 2 and _executor(it) == "inline":
            break
    assert _executor(it) == "inline"


def test_autotune_starts_inline_with_no_thread_as_the_plain_loop():
    before = set(threading.enumerate())
    it = iter(tp.range(100).prefetch(tp.AUTOTUNE).with_options(NO_INJECT))
    assert [next(it) for _ in range(5)] == list(range(5))
    assert _executor(it) == "inline" and not _prefetch_threads(before)


def _run_windows(choice, now, outside, seconds):
    """Deliver elements for ``seconds`` to ``choice``: 1 ms to make one, and the consumer's 1 ms
    between its requests; inline an element takes both, on the thread 2.6 ms (the two hold the
    GIL, and the hand-offs cost). Returns (now, outside, the modes seen)."""
    modes = set()
    end = now + seconds
    while now < end:
        element_s, pull_s = (2e-3, 1e-3) if choice.mode == INLINE else (2.6e-3, 1.6e-3)
        now += element_s
        outside += 1e-3
        modes.add(choice.delivered(now, outside, lambda p=pull_s: p))
    return now, outside, modes


def test_a_thread_that_loses_its_trial_is_tried_again_less_and_less_often():
    """Inline, a consumer working 1 ms between requests for 1 ms elements: the thread is tried
    (it may hide one behind the other); it measures slower and the input comes back inline. Its
    measurement then stands 20 s, not 10, and 40 s after the next loss."""
    choice = OverlapChoice(INLINE)
    now, outside, modes = _run_windows(choice, 0.0, 0.0, 0.5)
    assert modes == {INLINE, THREAD} and choice.mode == INLINE
    now, outside, modes = _run_windows(choice, now, outside, 15.0)
    assert modes == {INLINE}  # 15 s on: the thread's figure stands 20 s now
    now, outside, modes = _run_windows(choice, now, outside, 6.0)
    assert THREAD in modes and choice.mode == INLINE  # tried again once stale, and lost again
    lost_at = now
    now, outside, modes = _run_windows(choice, now, outside, 35.0)
    assert modes == {INLINE}
    now, outside, modes = _run_windows(choice, now, outside, 6.0)
    assert THREAD in modes and now - lost_at < 42.0


def test_the_input_runs_inline_only_while_no_stage_below_runs_ahead():
    from torchpipe.ops.parallel_map import ParallelMapIterator
    from torchpipe.ops.prefetch import runs_ahead

    cheap = iter(tp.range(10_000).map(abs, tp.AUTOTUNE, executor="auto").prefetch(tp.AUTOTUNE))
    with forced_call_costs(1e-7, gil_free=0.0, move_s=1e-5):  # cheaper than moving its result
        next(cheap)
    assert not runs_ahead(find_stage(cheap, ParallelMapIterator))  # its calls placed inline
    threads = iter(
        tp.range(8).map(abs, num_parallel_calls=2, executor="thread").prefetch(tp.AUTOTUNE)
    )
    next(threads)
    assert runs_ahead(find_stage(threads, ParallelMapIterator))
    choice = OverlapChoice(INLINE)
    assert (
        choice.delivered(1.0, 0.0, lambda: 1e-6, may_inline=lambda: False) == THREAD
    )  # back to the thread


def test_a_pass_that_starts_inline_starts_the_thread_when_a_stage_below_begins_to_run_ahead(
    monkeypatch,
):
    """The last pass left the input inline; in this one the map below moves to a pool: the
    prefetch's thread must start (there was none to resume) and nothing is lost."""
    from torchpipe.ops import prefetch

    pipeline = tp.range(400).map(abs, tp.AUTOTUNE, executor="auto").prefetch(tp.AUTOTUNE)
    assert list(pipeline) == list(range(400))
    earlier = iter(pipeline)
    next(earlier)
    leave_prefetch_in(earlier, INLINE)  # as an earlier pass may leave it
    del earlier
    it = iter(pipeline)
    got = [next(it) for _ in range(10)]
    assert _executor(it) == "inline"
    # the map below now runs on a pool
    monkeypatch.setattr(prefetch, "runs_ahead", lambda stage: True)
    got += list(it)
    assert got == list(range(400)) and _executor(it) == "thread"


def test_leave_in_takes_inline_or_thread_and_only_under_autotune():
    """PrefetchIterator.leave_in, the seam of testing.leave_prefetch_in."""
    it = iter(tp.range(10).prefetch(tp.AUTOTUNE).with_options(NO_INJECT))
    next(it)
    (stage,) = [s for s in stages(it) if isinstance(s, PrefetchIterator)]
    with pytest.raises(ValueError, match="not 'process'"):
        stage.leave_in("process")
    stage.leave_in(INLINE)
    assert stage.mode == INLINE
    it.close()
    fixed = iter(tp.range(10).prefetch(2).with_options(NO_INJECT))
    next(fixed)
    (stage,) = [s for s in stages(fixed) if isinstance(s, PrefetchIterator)]
    with pytest.raises(ValueError, match="AUTOTUNE"):
        stage.leave_in(THREAD)
    fixed.close()


def _row(i):
    return torch.full((256,), float(i))


def _process_map(n, depth):
    """A batched map on two worker processes (two tasks in flight each), a prefetch above."""
    ds = tp.from_dataset(range(n)).map(_row, 2, executor="process").batch(4).prefetch(depth)
    return ds.with_options(NO_INJECT)


def _records_in_rings(pool):
    """Results the workers wrote into their rings and the main process has not released."""
    return sum(
        (ring.slots or 0) - len(ring.free_slots())
        for rings in worker_rings(pool)
        for ring in rings
        if not ring.closed  # a ring replaced by one of another slot count, let go
    )


def _at_rest(it, pool, depth):
    """Records in the rings once the prefetch's buffer is full and the workers are done."""
    prefetch, last, deadline = find_stage(it, PrefetchIterator), -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.2)
        records = _records_in_rings(pool)
        if len(prefetch.buffer) == depth and records == last:
            return records
        last = records
    raise AssertionError("the prefetch's buffer did not fill")


@pytest.mark.parametrize("depth", [2, 6])
def test_a_prefetch_above_a_process_map_is_part_of_its_window(depth):
    # Each result is a record of a worker's ring: what the prefetch keeps counts as the map's
    # tasks in flight, so with the consumer away the rings hold the map's window (or the
    # buffer, where that is deeper), no more (before: 3 tasks more, 5 and 9 records here).
    firsts = []
    with iter(_process_map(240, depth)) as it:
        batch = next(it)  # (not enumerate(it): it keeps its last tuple, and the batch in it)
        pool = find_stage(it, ParallelMapIterator).process_pool
        assert pool.capacity == 4  # 2 workers, 2 tasks each
        while batch is not None:
            firsts.append(batch[:, 0].tolist())
            del batch
            if len(firsts) in (1, 30):
                assert _at_rest(it, pool, depth) <= max(pool.capacity, depth)
            batch = next(it, None)
    assert firsts == [[float(i) for i in range(k, k + 4)] for k in range(0, 240, 4)]


def _mib_row(i):
    return torch.full((1 << 18,), float(i))  # 1 MiB: batches of 4 MiB, LARGE_RESULT_BYTES


def test_large_results_below_a_prefetch_count_the_consumers_too_and_the_rings_drop_its_slot():
    # Batches of 4 MiB: the one the consumer holds counts as a task in flight too, so the
    # workers' rings need no slot for it (2 slots each, not 3) and hold 3 records at rest (4
    # where only the buffer counts).
    ds = tp.from_dataset(range(96)).map(_mib_row, 2, executor="process").batch(4).prefetch(2)
    firsts, at_rest = [], None
    with iter(ds.with_options(NO_INJECT)) as it:
        batch = next(it)
        pool = find_stage(it, ParallelMapIterator).process_pool
        while batch is not None:
            firsts.append(batch[:, 0].tolist())
            del batch
            if len(firsts) == 8:
                at_rest = _at_rest(it, pool, 2)
            batch = next(it, None)
        slots = ring_slots(it)
    assert slots == [2, 2]
    assert at_rest is not None and at_rest <= pool.capacity - 1
    assert firsts == [[float(i) for i in range(k, k + 4)] for k in range(0, 96, 4)]


def test_a_prefetch_above_a_process_map_resumes_exactly():
    assert_checkpoint_roundtrip(_process_map(24, 3), positions=[0, 2, 5])

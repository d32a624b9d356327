"""The dispatcher: ordered delivery over any executor, bounded waits, the stall check, switching."""

import threading
import time

import pytest

import torchpipe as tp
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.executor import InlineExecutor, ThreadExecutor


def _slow_square(seq, x):
    time.sleep(0.001 * ((x * 7) % 5))
    return x * x


def _drain(dispatch, in_order=True):
    out = []
    while dispatch.pending:
        seq, value, error = dispatch.take(in_order)
        out.append((seq, value if error is None else type(error)))
    return out


def test_results_come_back_in_sequence_order_whatever_order_they_finish_in():
    dispatch = Dispatcher("t", ThreadExecutor(_slow_square, 4, "t"))
    for seq in range(20):
        dispatch.submit(seq, seq)
    assert _drain(dispatch) == [(seq, seq * seq) for seq in range(20)]
    dispatch.close()


def test_as_completed_delivers_every_result_once():
    dispatch = Dispatcher("t", ThreadExecutor(_slow_square, 4, "t"))
    for seq in range(20):
        dispatch.submit(seq, seq)
    out = _drain(dispatch, in_order=False)
    assert sorted(out) == [(seq, seq * seq) for seq in range(20)]
    dispatch.close()


def test_results_put_in_place_and_errors_keep_their_places():
    dispatch = Dispatcher("t", InlineExecutor(lambda seq, x: 10 // x))
    dispatch.put(0, "computed elsewhere")
    dispatch.submit(1, 0)
    dispatch.submit(2, 5)
    assert _drain(dispatch) == [(0, "computed elsewhere"), (1, ZeroDivisionError), (2, 2)]
    with pytest.raises(LookupError):
        dispatch.take()


def test_switching_executors_mid_stream_loses_repeats_and_reorders_nothing():
    closed = []
    threads = ThreadExecutor(_slow_square, 3, "t")
    dispatch = Dispatcher("t", threads)
    out, seq = [], 0
    for executor in (
        InlineExecutor(_slow_square),
        ThreadExecutor(_slow_square, 2, "u"),
        InlineExecutor(_slow_square),
    ):
        for _ in range(10):
            dispatch.submit(seq, seq)
            seq += 1
        out += [dispatch.take() for _ in range(3)]
        dispatch.switch(executor, closed.append)  # tasks in flight finish where they are
    while dispatch.pending:
        out.append(dispatch.take())
    assert [(s, v) for s, v, _ in out] == [(s, s * s) for s in range(30)]
    assert threads in closed  # retired once its tasks were done


def test_a_deadline_bounds_the_wait():
    gate = threading.Event()
    dispatch = Dispatcher("t", ThreadExecutor(lambda seq, x: gate.wait(5), 1, "t"))
    dispatch.submit(0, None)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        dispatch.take(deadline=time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 2
    gate.set()
    assert dispatch.take()[1] is True
    dispatch.close()


def test_a_stalled_element_raises_naming_the_stage_the_element_and_the_thread():
    gate = threading.Event()
    dispatch = Dispatcher(
        "map(stuck)", ThreadExecutor(lambda seq, x: gate.wait(10), 1, "tp-stuck"), stall_s=0.3
    )
    dispatch.submit(7, None)
    with pytest.raises(
        tp.StallError, match=r"map\(stuck\): element 7 .* thread tp-stuck-0"
    ) as info:
        dispatch.take()
    assert (info.value.stage, info.value.seq) == ("map(stuck)", 7)
    gate.set()
    dispatch.close()


def test_forgotten_tasks_results_are_ignored():
    dispatch = Dispatcher("t", ThreadExecutor(_slow_square, 2, "t"))
    for seq in range(4):
        dispatch.submit(seq, seq)
    dispatch.forget()
    assert dispatch.pending == 0
    dispatch.submit(10, 3)
    assert dispatch.take() == (10, 9, None)
    dispatch.close()


def test_tasks_left_on_a_switched_out_executor_are_waited_for_not_spun_on():
    """Back inline after a trial on threads: the dispatcher waits on the threads for their last
    results (an inline executor returns at once; looking at it over and over held the GIL the
    threads needed)."""
    threads = ThreadExecutor(lambda seq, x: time.sleep(0.2) or x, 2, "t")
    looks = {"inline": 0, "threads": 0}
    waited = []
    inline = InlineExecutor(lambda seq, x: x)
    for name, executor in (("inline", inline), ("threads", threads)):
        collect = executor.collect

        def counted(timeout, name=name, collect=collect):
            looks[name] += 1
            if name == "threads" and timeout > 0:
                waited.append(timeout)
            return collect(timeout)

        executor.collect = counted
    dispatch = Dispatcher("t", threads)
    for seq in range(2):
        dispatch.submit(seq, seq)
    dispatch.switch(inline)
    dispatch.submit(2, 2)
    assert _drain(dispatch) == [(0, 0), (1, 1), (2, 2)]
    assert waited  # on the threads, for 0.2 s
    # steps of 5 ms, not a spin (~8000 looks)
    assert looks["inline"] < 200 and looks["threads"] < 200
    dispatch.close()


def test_tasks_sent_ahead_to_another_executor_are_delivered_in_their_places_and_it_is_retired():
    """A worker started ahead of the dispatcher (the DataLoader's head start) was sent tasks 1-2
    while task 0 ran here: 0 put after them, 3 sent after, every one delivered once, in order,
    and the executor they ran on retired once they are done."""
    retired = []
    ahead = ThreadExecutor(_slow_square, 1, "ahead")
    ahead.submit(1, 1)
    ahead.submit(2, 2)
    dispatch = Dispatcher("t", InlineExecutor(_slow_square))
    dispatch.adopt(ahead, [1, 2], retired.append)
    dispatch.put(0, 0)  # the first call, made here after the others were sent
    dispatch.submit(3, 3)
    assert _drain(dispatch) == [(s, s * s) for s in range(4)]
    assert retired == [ahead]


def test_an_executor_switched_back_to_while_it_finishes_tasks_is_not_retired():
    retired = []
    threads = ThreadExecutor(_slow_square, 2, "t")
    dispatch = Dispatcher("t", threads)
    dispatch.submit(0, 3)
    dispatch.switch(InlineExecutor(_slow_square), retired.append)
    dispatch.switch(threads, retired.append)  # back, before task 0 was collected
    dispatch.submit(1, 4)
    assert _drain(dispatch) == [(0, 9), (1, 16)]
    assert threads not in retired and len(retired) == 1  # the inline one, at once
    dispatch.submit(2, 5)  # still running
    assert _drain(dispatch) == [(2, 25)]
    dispatch.close()

"""The one builder of an auto stage: its executors of each kind, their moves, retiring and the knob."""

import pytest
import torch

from torchpipe.runtime.executor import ThreadExecutor
from torchpipe.runtime.placement.auto_stage import AutoStage, StageCalls, pass_candidates
from torchpipe.runtime.placement.costs import INLINE, KINDS, PROCESS, THREAD, CallCosts
from torchpipe.runtime.placement.policy import Policy
from torchpipe.runtime.recycle import RecycledStack
from torchpipe.runtime.timing import CallTiming


class _Pool(ThreadExecutor):
    """Stands in for a process pool: threads that tag their results, and remember their sizes."""

    def __init__(self):
        super().__init__(lambda seq, x: (PROCESS, x), 1, "pool")
        self.sizes = []
        self.closed = False
        self.slot_pages = True
        self.told = []  # every set_slot_pages, in order
        self.zygote_released = 0

    def release_zygote(self):
        self.zygote_released += 1
        return True

    def set_slot_pages(self, keep):
        self.slot_pages = keep
        self.told.append(keep)

    def resize(self, size):
        self.sizes.append(size)
        super().resize(max(size, 1))

    def close(self):
        self.closed = True
        super().close()


def _stage(policy=None, moves=None, pages_back=None, parks=None):
    pool = _Pool()

    def processes(workers):
        pool.resize(workers)
        return pool

    calls = StageCalls(lambda seq, x: (INLINE, x), lambda seq, x: (THREAD, x), processes=processes)
    on_move = (lambda kind, n: moves.append((kind, n))) if moves is not None else None
    stage = AutoStage(
        "map(f)",
        calls,
        CallTiming(),
        policy,
        stall_s=10.0,
        on_move=on_move,
        pages_back=pages_back,
        parks=parks,
    )
    return stage, pool


def _run(stage, first, count):
    """Submit ``count`` tasks from ``first`` on, and take them all, in order."""
    for seq in range(first, first + count):
        stage.dispatcher.submit(seq, seq)
    return [stage.dispatcher.take() for _ in range(count)]


def test_each_kind_runs_the_stages_call_for_it_and_moves_keep_every_element_in_order():
    stage, pool = _stage()
    out, seq = [], 0
    for kind, workers in ((INLINE, 0), (THREAD, 2), (PROCESS, 3), (INLINE, 0), (PROCESS, 1)):
        stage.placement.move(kind, workers)
        assert (stage.kind, stage.workers) == (kind, workers)
        out += _run(stage, seq, 5)
        assert {value[0] for _, value, _ in out[-5:]} == {kind}
        seq += 5
    assert [(s, value[1]) for s, value, _ in out] == [(s, s) for s in range(25)]
    # parked with its workers up when the calls left it
    assert pool.sizes == [3, 1] and not pool.closed
    stage.dispatcher.close()


def test_a_thread_pool_the_calls_leave_is_closed_and_the_process_pool_parked(monkeypatch):
    closed, threads = [], None
    close = ThreadExecutor.close
    # only this test's pool: another test's, collected meanwhile, closes too (under load)
    monkeypatch.setattr(
        ThreadExecutor,
        "close",
        lambda self: (self is threads and closed.append(self)) or close(self),
    )
    stage, pool = _stage()
    threads = stage.make(THREAD, 2)
    stage.retire(threads)
    assert closed == [threads]
    stage.retire(stage.make(PROCESS, 2))
    assert pool.sizes == [2] and closed == [
        threads
    ]  # parked: its workers wait for a window's verdict
    assert pool.zygote_released == 0
    # a window away from it kept the calls there: its workers go, and its zygote (a new one is
    # forked if they come back)
    stage.settled()
    assert pool.sizes == [2, 0] and not pool.closed and pool.zygote_released == 1
    stage.settled()
    assert pool.sizes == [2, 0] and pool.zygote_released == 1  # once
    stage.dispatcher.close()


class _Measured(Policy):
    """A policy whose measurements the test sets."""

    def __init__(self, measured):
        super().__init__(KINDS, 2)
        self.fixed = measured

    @property
    def measured(self):
        return dict(self.fixed)


@pytest.mark.parametrize("to", [THREAD, INLINE])
def test_a_pool_the_calls_leave_for_an_executor_measured_faster_lets_its_processes_go(to):
    """Not parked for a window: its workers and zygote go once its tasks are done; a trial of
    an executor not measured yet (or measured slower) parks it as before."""
    policy = _Measured({PROCESS: 2e-3})
    stage, pool = _stage(policy)
    stage.placement.move(PROCESS, 2)
    _run(stage, 0, 4)
    stage.placement.move(to, 2)  # a trial: nothing measured there yet
    assert pool.sizes == [2] and pool.zygote_released == 0
    stage.placement.move(PROCESS, 2)
    _run(stage, 4, 4)
    policy.fixed[to] = 1e-3  # measured faster than the processes
    stage.placement.move(to, 2)
    _run(stage, 8, 4)
    assert pool.sizes == [2, 2, 0] and pool.zygote_released == 1
    stage.settled()
    assert pool.sizes == [2, 2, 0] and pool.zygote_released == 1  # nothing parked left
    stage.placement.move(PROCESS, 2)  # a later trial asks for workers again
    assert [value[0] for _, value, _ in _run(stage, 12, 4)] == [PROCESS] * 4
    assert pool.sizes == [2, 2, 0, 2]
    stage.dispatcher.close()


def test_calls_that_come_back_to_the_parked_pool_after_a_window_elsewhere_find_its_workers_up():
    stage, pool = _stage()
    stage.placement.move(PROCESS, 2)
    _run(stage, 0, 4)
    stage.placement.move(THREAD, 2)  # the policy tries threads for a window
    _run(stage, 4, 4)
    stage.placement.move(PROCESS, 2)  # measured slower: back, to the workers kept up
    assert [value[0] for _, value, _ in _run(stage, 8, 4)] == [PROCESS] * 4
    assert pool.sizes == [2, 2] and not pool.closed  # never resized to 0: nothing forked again
    stage.settled()  # a window on processes: nothing parked, nothing to let go
    assert pool.sizes == [2, 2] and pool.zygote_released == 0
    stage.dispatcher.close()


@pytest.mark.parametrize("trial", [THREAD, INLINE])
def test_the_parked_pools_slots_give_their_pages_back_while_a_trial_runs_elsewhere(trial):
    """A trial's results would otherwise peak with the parked rings' pages: they are released
    while the calls run elsewhere, and kept again when the calls come back."""
    stage, pool = _stage()
    stage.placement.move(PROCESS, 2)
    _run(stage, 0, 4)
    assert pool.slot_pages and pool.told == []
    stage.placement.move(trial, 0 if trial == INLINE else 2)
    assert not pool.slot_pages  # before the trial's first task
    _run(stage, 4, 4)
    stage.placement.move(INLINE if trial == THREAD else THREAD, 2)  # still away: told once
    assert pool.told == [False]
    stage.placement.move(PROCESS, 2)
    assert pool.slot_pages and pool.told == [False, True]
    assert [value[0] for _, value, _ in _run(stage, 8, 4)] == [PROCESS] * 4
    stage.dispatcher.close()


def test_slots_a_budget_released_stay_released_when_the_calls_come_back():
    budget_released = []
    stage, pool = _stage(pages_back=lambda: not budget_released)
    stage.placement.move(PROCESS, 2)
    stage.placement.move(THREAD, 2)
    budget_released.append(True)
    stage.placement.move(PROCESS, 2)
    assert not pool.slot_pages and pool.told == [False]
    stage.placement.move(THREAD, 2)  # released already: nothing to tell, nothing to restore
    stage.placement.move(PROCESS, 2)
    assert pool.told == [False]
    stage.dispatcher.close()


def test_a_pool_under_a_budget_that_binds_is_not_parked_its_workers_go():
    """Under a RAM budget that binds (slots released, or fewer batches in flight), a trial
    elsewhere would peak with the parked workers' heaps (``jpeg``'s budget row: 135 MB against
    its budget of 103, on two threads beside two parked workers): the workers go at once, the
    zygote stays to fork them again."""
    budget_released = [True]
    stage, pool = _stage(parks=lambda: not budget_released)
    stage.placement.move(PROCESS, 2)
    _run(stage, 0, 4)
    stage.placement.move(THREAD, 2)
    _run(stage, 4, 4)
    assert pool.sizes == [2, 0] and pool.zygote_released == 0 and not pool.closed
    stage.placement.move(PROCESS, 2)  # back: its workers forked again
    assert [value[0] for _, value, _ in _run(stage, 8, 4)] == [PROCESS] * 4
    assert pool.sizes == [2, 0, 2]
    budget_released.clear()  # no budget binds: parked as before
    stage.placement.move(THREAD, 2)
    _run(stage, 12, 4)
    assert pool.sizes == [2, 0, 2]
    stage.dispatcher.close()


def test_the_heap_is_given_back_when_threads_are_left_or_the_calls_leave_this_process(monkeypatch):
    """Threads' arenas and the inline calls' freed elements are trimmed once nothing here makes
    the results any more; not on a move from inline to threads (the calls still run here)."""
    import torchpipe.runtime.placement.auto_stage as auto_stage

    trims = []
    monkeypatch.setattr(auto_stage, "trim_heap", lambda: trims.append(stage.kind))
    stage, _ = _stage()
    _run(stage, 0, 2)
    stage.placement.move(THREAD, 2)  # inline -> threads: the main thread still calls
    _run(stage, 2, 2)
    assert trims == []
    stage.placement.move(INLINE, 0)  # threads left: their arenas
    assert len(trims) == 1
    # inline -> processes: the main heap, before the pool forks (a zygote forked now would copy
    # what the calls here left free) and once the inline calls are done
    stage.placement.move(PROCESS, 2)
    assert len(trims) == 3
    _run(stage, 4, 2)
    stage.placement.move(THREAD, 2)  # the process pool is parked, not closed: no trim
    assert len(trims) == 3
    stage.settled()  # a window later the results in flight then were delivered: once more
    stage.settled()
    assert len(trims) == 4
    stage.dispatcher.close()


def test_the_heap_is_given_back_when_fewer_threads_make_the_calls(monkeypatch):
    """Threads that exit leave their arenas' free memory: trimmed at the first window after
    (their last results delivered), not on more threads, nor while the count stays."""
    import torchpipe.runtime.placement.auto_stage as auto_stage

    trims = []
    monkeypatch.setattr(auto_stage, "trim_heap", lambda: trims.append(stage.workers))
    stage, _ = _stage()
    stage.placement.move(THREAD, 2)
    stage.placement.resize(4)  # the tuner asks for more threads
    _run(stage, 0, 8)
    stage.settled()
    assert trims == []
    stage.placement.resize(2)  # and fewer again
    assert trims == []  # their last results may still be in flight
    _run(stage, 8, 4)
    stage.settled()
    stage.settled()
    assert trims == [2]  # once
    stage.dispatcher.close()


def test_the_heap_is_trimmed_before_the_process_pool_forks_its_zygote(monkeypatch):
    """A zygote forked from threads that just made batches (a trial of processes after threads,
    or a new zygote once the last went) would copy their arenas' free memory: it is given back
    first, before the pool is asked for workers."""
    import torchpipe.runtime.placement.auto_stage as auto_stage

    events = []
    monkeypatch.setattr(auto_stage, "trim_heap", lambda: events.append("trim"))
    pool = _Pool()

    def processes(workers):
        events.append("fork")
        pool.resize(workers)
        return pool

    calls = StageCalls(lambda seq, x: x, lambda seq, x: x, processes=processes)
    stage = AutoStage("map(f)", calls, CallTiming(), None)
    stage.placement.move(THREAD, 2)
    _run(stage, 0, 4)
    events.clear()
    stage.placement.move(PROCESS, 2)
    assert events[:2] == ["trim", "fork"]
    stage.dispatcher.close()


def test_batch_memory_kept_here_goes_before_the_process_pool_is_made_and_returns_after():
    """A zygote forked while the buffers are kept would copy them: they go first."""
    memory = RecycledStack(min_bytes=1)
    batch = memory([torch.zeros(1024)] * 4)
    del batch
    kept_then = []
    pool = _Pool()

    def processes(workers):
        kept_then.append(memory.free_bytes)
        pool.resize(workers)
        return pool

    calls = StageCalls(lambda seq, x: x, lambda seq, x: x, processes=processes)
    stage = AutoStage("map(f)", calls, CallTiming(), None, memory=memory)
    assert memory.free_bytes == 4 * 4096
    stage.placement.move(PROCESS, 2)
    assert kept_then == [0]
    stage.placement.move(THREAD, 2)  # made here again: kept again
    batch = memory([torch.zeros(1024)] * 4)
    del batch
    assert memory.free_bytes == 4 * 4096
    stage.dispatcher.close()


def test_the_knob_follows_every_move_and_its_zero_means_inline():
    moves = []
    stage, _ = _stage(Policy((INLINE, THREAD), 2), moves)
    knob = stage.add_knob(0, 0, 8)
    assert knob.name == "map(f).parallelism" and (knob.minimum, knob.maximum) == (0, 8)
    stage.placement.move(THREAD, 3)
    assert knob.value == 3
    knob.request(0)
    knob.take_request()  # what the stage does before its next element
    assert stage.kind == INLINE and knob.value == 0
    assert moves == [(THREAD, 3), (INLINE, 0)]
    stage.dispatcher.close()


def test_only_inline_with_nothing_in_flight_runs_here():
    stage, _ = _stage()
    assert stage.runs_here() and stage.call_here(0, 7) == (INLINE, 7)
    stage.placement.move(THREAD, 1)
    assert not stage.runs_here()
    stage.dispatcher.submit(1, 1)
    stage.placement.move(INLINE, 0)
    assert not stage.runs_here()  # a task is still out on a thread
    stage.dispatcher.take()
    assert stage.runs_here()
    stage.dispatcher.close()


def test_a_kind_the_stage_has_no_executor_of_is_an_error_naming_the_stage():
    stage = AutoStage("map(f)", StageCalls(abs, abs), CallTiming(), None)
    with pytest.raises(ValueError, match=r"map\(f\): no 'process' executor"):
        stage.make(PROCESS, 2)


def test_a_pass_drops_processes_only_where_they_cannot_fork_or_were_seen_not_to_pay():
    # moving a result costs 1000 calls
    cheap = CallCosts(call_s=1e-6, cpu_s=1e-6, gil_free=0.0, move_s=1e-3)
    first = {"last": None, "costs": None, "measured": {}, "cores": 4}
    assert pass_candidates(inline=True, processes=True, **first) == KINDS
    assert pass_candidates(inline=False, processes=True, **first) == (THREAD, PROCESS)
    assert pass_candidates(inline=True, processes=False, **first) == (INLINE, THREAD)
    seen = {"last": INLINE, "costs": cheap, "measured": {}, "cores": 4}
    assert pass_candidates(inline=True, processes=True, **seen) == (INLINE, THREAD)
    assert pass_candidates(inline=True, processes=True, **{**seen, "last": PROCESS}) == KINDS

"""The shared harness must catch the bugs it exists for."""

import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch

import torchpipe as tp
import torchpipe.testing
from tests.processes import wait_dead
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import Node
from torchpipe.testing import (
    assert_checkpoint_roundtrip,
    assert_elements_equal,
    assert_exactly_once,
    assert_same_elements,
    find_stage,
    forced_call_costs,
    keep_calls,
    knobs,
    leave_prefetch_in,
    move_calls,
    node,
    open_readers,
    reader_capacity,
    release_readers,
    running_node,
    stages,
    start_as_measured,
    worker_pids,
    worker_rings,
    zygote_pids,
)


class BrokenNode(Node):
    """A deliberately broken op: its input wrapped in one of the broken iterators below."""

    kind = "broken"

    def __init__(self, input, iterator):
        super().__init__(input)
        self.iterator = iterator

    def build(self, ctx):
        return self.iterator(ctx.build_input(self))


def broken(iterator):
    return tp.Dataset(BrokenNode(node(tp.range(5)), iterator))


class ForgetfulIterator(Iterator):
    """Its checkpoint forgets the input position."""

    def __init__(self, source):
        super().__init__("broken", source)
        self.source = source
        self.started = False

    def next(self):
        return next(self.source)

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def test_roundtrip_catches_a_broken_checkpoint():
    with pytest.raises(AssertionError, match="resumed at 1"):
        assert_checkpoint_roundtrip(broken(ForgetfulIterator))


def test_roundtrip_passes_and_returns_elements():
    assert assert_checkpoint_roundtrip(tp.range(4)) == [0, 1, 2, 3]
    assert len(assert_checkpoint_roundtrip(tp.range(3).repeat(), max_elements=10)) == 10


@pytest.mark.parametrize(
    "a, b",
    [
        (torch.tensor([1, 2]), torch.tensor([1, 3])),
        (torch.tensor([1, 2]), torch.tensor([1.0, 2.0])),
        (torch.tensor([1, 2]), np.array([1, 2])),
        (np.array([1, 2], np.int32), np.array([1, 2], np.int64)),
        ((1, 2), [1, 2]),
        ({"a": 1}, {"b": 1}),
        (1, 1.0),
        ("a", b"a"),
        ((1,), (1, 2)),
    ],
)
def test_elements_equal_detects_differences(a, b):
    with pytest.raises(AssertionError):
        assert_elements_equal(a, b)


def test_elements_equal_accepts_equal_values_and_nans():
    assert_elements_equal(
        {"x": (torch.tensor([float("nan"), 1.0]), "s")},
        {"x": (torch.tensor([float("nan"), 1.0]), "s")},
    )
    assert_elements_equal(np.array([np.nan]), np.array([np.nan]))
    assert_elements_equal(float("nan"), float("nan"))
    with pytest.raises(AssertionError, match="3 elements vs 2"):
        assert_same_elements([1, 2, 3], [1, 2])


def test_unordered_roundtrip_compares_multisets():
    assert_checkpoint_roundtrip(tp.range(5).map(lambda x: x, 2, deterministic=False), ordered=False)


class DriftingIterator(ForgetfulIterator):
    """Its state gains a key after the first element."""

    def next(self):
        self.started = True
        return next(self.source)

    def get_state(self):
        state = {"input": self.source.state_dict()}
        return {**state, "started": True} if self.started else state

    def set_state(self, state):
        self.source.load_state_dict(state["input"])
        self.started = "started" in state


class SloppyIterator(DriftingIterator):
    """After a load its state is not the state it loaded."""

    def get_state(self):
        return {"input": self.source.state_dict(), "started": self.started}

    def set_state(self, state):
        self.source.load_state_dict(state["input"])
        self.started = int(state["started"])  # resumes right, but the state now says 1, not True


def test_roundtrip_catches_a_state_whose_structure_changes():
    with pytest.raises(
        AssertionError,
        match=r"structure changed between positions 0 and 1: .* has keys \['input'\], then \['input', 'started'\]",
    ):
        assert_checkpoint_roundtrip(broken(DriftingIterator))


def test_roundtrip_catches_a_state_that_does_not_survive_a_load():
    with pytest.raises(AssertionError, match=r"state_dict\(\) after load_state_dict\(\)"):
        # without the injected prefetch, which hands back the state it loaded until it moves
        no_prefetch = tp.Options(optimizations={"inject_prefetch": False})
        assert_checkpoint_roundtrip(broken(SloppyIterator).with_options(no_prefetch))


class EpochForgetting:
    """A deliberately broken dataset: a resumed iterator leaves the epoch counter where it was."""

    def __init__(self):
        self.epochs = 0

    def options(self):
        return tp.Options(seed=0)

    def __iter__(self):
        self.epochs += 1
        return EpochIterator(self.epochs - 1)


class EpochIterator:
    def __init__(self, epoch):
        self.epoch, self.position = epoch, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position == 3:
            raise StopIteration
        self.position += 1
        return self.epoch, self.position - 1

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]

    def close(self):
        pass


def test_roundtrip_runs_the_epoch_after_a_resume():
    with pytest.raises(AssertionError, match="resumed at 0: the next pass is epoch 3, not 1"):
        assert_checkpoint_roundtrip(EpochForgetting())
    seeded = tp.range(8).shuffle(8).with_options(tp.Options(seed=1))
    assert sorted(assert_checkpoint_roundtrip(seeded)) == list(range(8))


_TEST_PROCESS = os.getpid()


def _square_in_a_worker_that_ignores_sigterm(x):
    if os.getpid() != _TEST_PROCESS:  # in a worker process (on its main thread: one task at a time)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return x * x


def test_exactly_once_sends_the_signal_asked_for():
    def make():
        return tp.range(120).map(_square_in_a_worker_that_ignores_sigterm, 2, executor="process")

    assert assert_exactly_once(make, signal=signal.SIGKILL) is not None  # SIGKILL cannot be ignored


def test_exactly_once_fails_when_the_signalled_worker_lives_on(monkeypatch):
    monkeypatch.setattr(torchpipe.testing, "SIGNAL_WAIT_S", 1.0)

    def make():
        return tp.range(120).map(_square_in_a_worker_that_ignores_sigterm, 2, executor="process")

    with pytest.raises(AssertionError, match=r"worker process \d+ still runs 1.0 s after SIGTERM"):
        assert_exactly_once(make, signal=signal.SIGTERM)


class OneWorkerRun:
    """A deliberately broken iterable: ``range(20)`` from a generator with one worker process.

    When the worker dies, the element in flight is lost or handed out twice (``mode``), or,
    with ``mode="always lose"``, element 3 is lost in every run, killed or not.
    """

    def __init__(self, mode):
        self.mode = mode
        self.broken_at = None

    def __call__(self):
        return self._elements(
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        )

    def _elements(self, worker):
        try:
            for x in range(20):
                if self.broken_at is None and _died(worker):  # the harness killed it
                    self.broken_at = x
                    if self.mode == "lose":
                        continue
                    if self.mode == "repeat":
                        yield x - 1
                if not (self.mode == "always lose" and x == 3):
                    yield x
        finally:
            worker.kill()
            worker.wait()


def _died(worker, wait_s=0.005):
    """Whether the ``worker`` process has died, given a moment to (a SIGKILL lands within it)."""
    try:
        worker.wait(wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize(
    "mode, named",
    [
        ("lose", "lost: [{x}]; repeated or unexpected: []"),
        ("repeat", "lost: []; repeated or unexpected: [{previous}]"),
    ],
    ids=["lost", "repeated"],
)
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_exactly_once_names_an_element_lost_or_repeated_when_the_worker_dies(mode, named, ordered):
    run = OneWorkerRun(mode)
    with pytest.raises(AssertionError) as caught:
        assert_exactly_once(run, seed=1, ordered=ordered)
    assert run.broken_at is not None  # the harness killed the worker
    assert "21 elements" in str(caught.value) or "19 elements" in str(caught.value)
    assert named.format(x=run.broken_at, previous=run.broken_at - 1) in str(caught.value)


def test_exactly_once_passes_a_run_that_survives_the_kill_and_returns_the_pid():
    run = OneWorkerRun("survive")
    assert assert_exactly_once(run, seed=1, expected=range(20)) is not None
    assert run.broken_at is not None


def test_exactly_once_against_an_expectation_catches_a_loss_in_every_run():
    always = OneWorkerRun("always lose")
    assert_exactly_once(always, seed=1)  # the undisturbed run loses it too: nothing to see
    with pytest.raises(AssertionError, match=r"19 elements, expected 20; lost: \[3\]"):
        assert_exactly_once(OneWorkerRun("always lose"), seed=1, expected=range(20))


# -- hooks into a running pass ------------------------------------------------------------------
def _python_heavy(x):
    return sum(i * i for i in range(2_000)) * 0 + x


def test_stages_are_the_running_op_iterators_root_first_and_find_stage_names_what_is_missing():
    from torchpipe.ops.parallel_map import ParallelMapIterator
    from torchpipe.ops.prefetch import PrefetchIterator

    it = iter(tp.range(10).map(abs, 2, executor="thread").prefetch(2))
    with pytest.raises(AssertionError, match="not started"):
        stages(it)
    assert next(it) == 0
    kinds = [type(stage) for stage in stages(it)]
    assert (
        kinds[:2] == [PrefetchIterator, ParallelMapIterator] and len(kinds) == 3
    )  # then the range
    assert find_stage(it, ParallelMapIterator) is stages(it)[1]
    with pytest.raises(AssertionError, match="no Node among the stages"):
        find_stage(it, Node)
    it.close()


def test_knobs_are_what_the_autotuner_turns():
    ds = (
        tp.range(50)
        .prefetch(tp.AUTOTUNE)
        .with_options(tp.Options(autotune=tp.AutotuneOptions(enabled=False)))
    )
    it = iter(ds)
    next(it)
    (knob,) = knobs(it)
    knob.request(7)
    assert it.stats()[0]["knobs"]["prefetch.buffer_size"] == 7 and list(it) == list(range(1, 50))
    # fixed workers: nothing to tune
    assert knobs(iter(tp.DataLoader(range(8), num_workers=2))) == []


def test_move_calls_moves_an_auto_stage_and_loses_nothing():
    it = iter(tp.range(200).map(abs, tp.AUTOTUNE, executor="auto"))
    out = [next(it) for _ in range(10)]
    for kind, workers in (("thread", 3), ("process", 2), ("inline", 0)):
        move_calls(it, kind, workers)
        out += [next(it) for _ in range(20)]
        mapped = next(s for s in it.stats() if s["stage"].startswith("map"))
        assert (mapped["executor"], mapped["workers"]) == (kind, workers)
    assert out + list(it) == list(range(200))
    fixed = iter(tp.range(5).map(abs, 2, executor="thread"))
    next(fixed)
    with pytest.raises(AssertionError, match="placed by a policy"):
        move_calls(fixed, "process", 2)


@pytest.mark.parametrize("gil_free, kind", [(0.0, "process"), (1.0, "thread")])
def test_forced_call_costs_decide_the_first_placement_and_are_undone_after(gil_free, kind):
    from torchpipe.runtime.placement.measure import measure_calls

    def run(n):
        return list(range(n))

    with forced_call_costs(1e-3, gil_free=gil_free, cpu_s=1e-3 * (1 - gil_free) + 1e-6):
        assert measure_calls(run)[0].call_s == 1e-3
        it = iter(tp.range(20).map(_python_heavy, 2, executor="auto"))
        assert list(it) == list(range(20))
    assert measure_calls(run)[0].call_s < 1e-3  # measured again: a list's element costs less
    assert next(s for s in it.stats() if s["stage"].startswith("map"))["executor"] == kind


def test_zygote_pids_are_the_parents_of_the_worker_processes():
    it = iter(tp.range(100).map(lambda x: os.getpid(), 2, executor="process"))
    pids = {next(it) for _ in range(10)}
    (zygote,) = zygote_pids(it)
    assert {psutil.Process(pid).ppid() for pid in pids} == {zygote}
    it.close()
    threads = iter(tp.range(5).map(abs, 2, executor="thread"))
    next(threads)
    assert zygote_pids(threads) == []


def test_a_window_kept_away_from_the_process_pool_lets_its_workers_and_zygote_go():
    """keep_calls plays the window that keeps the calls on threads: the parked workers and
    their zygote end; back on processes a new zygote forks new workers."""
    with forced_call_costs(1e-3, gil_free=0.0, moves=False):
        it = iter(tp.range(10**6).map(lambda x: os.getpid(), 2, executor="auto"))
        next(it)
    move_calls(it, "process", 2)
    pids = {next(it) for _ in range(20)} - {os.getpid()}
    (zygote,) = zygote_pids(it)
    assert len(pids) == 2 and {psutil.Process(pid).ppid() for pid in pids} == {zygote}
    move_calls(it, "thread", 2)
    assert {next(it) for _ in range(8)} <= pids | {os.getpid()}  # the last in flight, then here
    keep_calls(it)
    assert zygote_pids(it) == [] and wait_dead([zygote, *pids]) == []
    move_calls(it, "process", 2)
    again = {next(it) for _ in range(20)} - {os.getpid()}
    (second,) = zygote_pids(it)
    assert second != zygote and again and {psutil.Process(p).ppid() for p in again} == {second}
    it.close()


def test_worker_pids_and_rings_are_the_pools():
    from torchpipe.runtime.processes.pool import ProcessPool
    from torchpipe.runtime.processes.shm_ring import ShmRing

    pool = ProcessPool(lambda seq, x: torch.full((1000,), float(x)), 2, "m")
    pool.start()
    try:
        for seq in range(4):
            pool.submit(seq, seq)
        results = []
        while len(results) < 4:
            results += pool.collect(1.0)
        assert sorted(worker_pids(pool)) == sorted(pool.pids)
        rings = worker_rings(pool)
        assert len(rings) == 2 and all(isinstance(ring, ShmRing) for each in rings for ring in each)
    finally:
        pool.close()


def test_node_is_as_written_and_running_node_as_it_will_run():
    ds = tp.range(4).map(abs).map(abs)
    assert node(ds).kind == "map" and node(ds).inputs[0].kind == "map"
    running = running_node(ds)
    assert [running.kind, running.inputs[0].kind, running.inputs[0].inputs[0].kind] == [
        "prefetch",
        "fused_map",
        "range",
    ]


def test_open_readers_release_and_capacity_are_the_interleaves():
    ds = tp.range(4).interleave(
        lambda x: tp.range(3), cycle_length=2, num_parallel_calls=2, executor="thread"
    )
    with iter(ds) as it:
        next(it)
        readers = open_readers(it)
        assert len(readers) >= 2 and reader_capacity(it) >= 1
        places = release_readers(it, readers)
        assert [place.seq for place in places] == [reader.seq for reader in readers]


def test_start_as_measured_takes_only_an_auto_loader():
    with pytest.raises(AssertionError, match="num_workers='auto'"):
        start_as_measured(tp.DataLoader(range(4), num_workers=2), 1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    loader = tp.DataLoader(Stream(), num_workers="auto")
    start_as_measured(loader, 1, replicas=3)
    assert "running 3 replicas" in tp.explain(loader)


def test_leave_prefetch_in_is_where_the_next_pass_starts():
    ds = tp.range(50).prefetch(tp.AUTOTUNE)
    earlier = iter(ds)
    next(earlier)
    leave_prefetch_in(earlier, "inline")
    del earlier
    it = iter(ds)
    assert next(it) == 0
    assert next(s for s in it.stats() if s["stage"].startswith("prefetch"))["executor"] == "inline"
    assert list(it) == list(range(1, 50))
    fixed = iter(tp.range(5).prefetch(2))
    next(fixed)
    with pytest.raises(AssertionError, match="not prefetch"):
        leave_prefetch_in(fixed, "inline")


def test_as_in_a_fresh_process_forgets_the_process_memos_and_puts_them_back():
    from torchpipe.runtime.placement import costs
    from torchpipe.runtime.placement.gil import GilProbe

    GilProbe.calibrate()
    costs.observe_message_cost(5e-3)
    cost = costs.message_cost()
    with torchpipe.testing.as_in_a_fresh_process():
        assert costs.message_cost() == costs.MESSAGE_S  # none observed yet
        costs.observe_message_cost(7e-3)
        with GilProbe() as probe:  # calibrates afresh: a probe measures either way
            assert 0.0 <= probe.measure(lambda: None)[1] <= 1.0
    assert costs.message_cost() == cost


def _nap(x):
    import time

    time.sleep(0.001)
    return x


@pytest.mark.parametrize("moves", [True, False])
def test_forced_call_costs_can_keep_the_calls_where_the_costs_placed_them(monkeypatch, moves):
    """Whatever the windows measure (here: every window says threads), ``moves=False`` keeps a
    stage made in the block where the forced costs placed it; with ``moves=True`` they move it."""
    from torchpipe.runtime.placement.costs import THREAD
    from torchpipe.runtime.placement.policy import Policy

    monkeypatch.setattr(Policy, "review", lambda self, seconds, full=True: THREAD)
    no_prefetch = tp.Options(optimizations={"inject_prefetch": False})
    # pure Python, 20 ms a call: processes, whatever this process has seen a result message cost
    with torchpipe.testing.forced_call_costs(2e-2, gil_free=0.0, moves=moves):
        it = iter(tp.range(1000).map(_nap, 2, executor="auto").with_options(no_prefetch))
        assert list(it) == list(range(1000))
    where = next(s for s in it.stats() if s["stage"].startswith("map"))["executor"]
    assert where == ("thread" if moves else "process")

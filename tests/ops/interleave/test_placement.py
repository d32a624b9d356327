"""interleave(executor="auto"): readers start on threads and move between threads and worker processes mid-pass."""

import dataclasses
import itertools
import os
import threading
import time

import psutil
import pytest

import torchpipe as tp
from tests.trees import find_stage, stage_stats
from torchpipe.core.stats import IteratorStats
from torchpipe.ops.interleave import interleave, process_readers
from torchpipe.ops.interleave import iterator as interleave_iterator
from torchpipe.ops.interleave import placement as reader_placement
from torchpipe.ops.interleave.iterator import InterleaveIterator
from torchpipe.ops.interleave.placement import ReaderPlacement, Window
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.placement.costs import PROCESS, THREAD
from torchpipe.runtime.processes.pool import ProcessPool
from torchpipe.runtime.timing import CallTiming
from torchpipe.testing import assert_checkpoint_roundtrip, open_readers, release_readers

NO_TUNER = tp.Options(
    autotune=tp.AutotuneOptions(enabled=False), optimizations={"inject_prefetch": False}
)


def _find(it):
    return find_stage(it, InterleaveIterator)


def _executor(it):
    """Where the readers read now, as the stats say: ``thread`` or ``process`` (``auto`` while measuring)."""
    return stage_stats(it, "interleave")["executor"]


def _verdicts(monkeypatch, kinds):
    """Judge every 3 elements, and have the policy's verdicts be ``kinds(window number)``."""
    cadence = dataclasses.replace(
        reader_placement.READS,
        elements=4,
        seconds=0.0,
        settle_elements=3,
        every=3,
        settle_s=0.0,
        settle_process_s=0.0,
    )
    monkeypatch.setattr(reader_placement, "READS", cadence)
    verdict, windows = ReaderPlacement.verdict, []

    def forced(self, window):
        verdict(self, window)  # measures the costs, as the move needs them
        windows.append(window)
        return kinds(len(windows))

    monkeypatch.setattr(ReaderPlacement, "verdict", forced)


@pytest.fixture
def switch_early(monkeypatch):
    """Decide after a few reads, for processes whatever the readers cost."""
    _verdicts(monkeypatch, lambda window: PROCESS)


def _records(x):
    return tp.range(x % 7 + 5).map(lambda y: (x, y, os.getpid()))


def _burn(x):
    def work(y):
        deadline = time.thread_time() + 300e-6  # Python work a reader does per element
        while time.thread_time() < deadline:
            pass
        return x, y, os.getpid()

    return tp.range(40).map(work)


def _values(elements):
    return [(x, y) for x, y, _ in elements]


@pytest.mark.parametrize("cycle, block", [(1, 1), (3, 2), (4, 1)])
def test_the_handover_keeps_the_inline_order(switch_early, cycle, block):
    inline = list(tp.range(30).interleave(_records, cycle_length=cycle, block_length=block))
    ds = tp.range(30).interleave(
        _records, cycle_length=cycle, block_length=block, num_parallel_calls=3
    )
    it = iter(ds.with_options(NO_TUNER))
    out = list(it)
    assert _values(out) == _values(inline)
    pids = [pid for *_, pid in out]
    assert pids[0] == os.getpid() and pids[-1] != os.getpid()  # threads first, then processes
    assert _executor(it) == "process"


class _LoggedReads:
    """Inner datasets that append every element they read to a file, from threads or processes."""

    def __init__(self, path):
        self.path = path

    def __call__(self, x):
        def read(y):
            with open(self.path, "a") as f:  # one short append: whole lines, whichever process
                f.write(f"{x},{y}\n")
            return x, y, os.getpid()

        return tp.range(x % 7 + 5).map(read)


def test_what_threads_read_ahead_moves_over_and_is_not_read_again(switch_early, tmp_path):
    reads = _LoggedReads(str(tmp_path / "reads"))
    ds = tp.range(30).interleave(reads, cycle_length=3, num_parallel_calls=3)
    it = iter(ds.with_options(NO_TUNER))
    out = list(it)
    assert _executor(it) == "process"
    assert _values(out) == _values(tp.range(30).interleave(_records, cycle_length=3))
    lines = (tmp_path / "reads").read_text().splitlines()
    assert sorted(lines) == sorted(f"{x},{y}" for x, y in _values(out))  # each element read once


def _slow_reads(x):
    # waits, like remote storage
    return tp.range(6).map(lambda y: (time.sleep(0.002), (x, y, os.getpid()))[1])


def test_the_workers_run_the_readers_on_their_threads_from_the_first_task(
    switch_early, monkeypatch
):
    threads_at_submit = []
    submit = ProcessPool.submit

    def recording_submit(self, *args, **kwargs):
        threads_at_submit.append(self.threads)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(ProcessPool, "submit", recording_submit)
    ds = tp.range(12).interleave(_slow_reads, cycle_length=2, num_parallel_calls=tp.AUTOTUNE)
    it = iter(ds.with_options(NO_TUNER))
    assert _values(list(it)) == _values(tp.range(12).interleave(_slow_reads, cycle_length=2))
    assert _executor(it) == "process"
    # Reads that wait: the knob jumps to many reads in flight, threads in each worker; the
    # handed-over readers' first chunks already run on them (not one by one).
    assert (
        threads_at_submit
        and set(threads_at_submit) == {threads_at_submit[0]}
        and threads_at_submit[0] > 1
    )


def test_the_non_deterministic_order_holds_on_both_sides_of_the_handover(switch_early):
    ds = tp.range(30).interleave(
        _records, cycle_length=3, num_parallel_calls=3, deterministic=False
    )
    it = iter(ds.with_options(NO_TUNER))
    out = list(it)
    assert _executor(it) == "process"
    assert sorted(_values(out)) == sorted(
        _values(tp.range(30).interleave(_records, cycle_length=3))
    )
    assert _find(it).deterministic is False


def test_a_read_in_progress_does_not_hold_up_the_handover():
    release = threading.Event()

    def blocking(x):
        def element(y):
            if x == 1 and y == 2:
                release.wait(10)  # a slow read, in progress when the handover comes
            return x, y

        return tp.range(4).map(element)

    ds = tp.range(2).interleave(blocking, cycle_length=2, num_parallel_calls=2, executor="thread")
    with iter(ds.with_options(NO_TUNER)) as it:
        assert next(it) == (0, 0)
        readers = open_readers(it)
        first, second = (next(r for r in readers if r.seq == seq) for seq in (0, 1))
        deadline = time.monotonic() + 5
        # the second has read (1, 0) and (1, 1), and waits in (1, 2); the first has read to its
        # end (on a loaded machine its reads may still be under way when the second's are)
        while (len(second.ready) < 2 or len(first.ready) < 4) and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.perf_counter()
        places = release_readers(it, readers)
        assert time.perf_counter() - t0 < 1.0
        release.set()
    entries = {place.seq: place for place in places}
    assert entries[1].read_ahead == ()  # read again by the successor, from the items taken
    assert [kind for kind, _, _ in entries[0].read_ahead] == ["value", "value", "value", "end"]


def test_readers_that_do_python_work_move_to_processes(monkeypatch):
    # What a window measures swings with the machine's load: every window says what reads that
    # hold the GIL measure on an idle machine (as in test_the_executor_policy_decides_the_handover).
    python_work = Window(0.1, 64, 64, 64 * 200e-6, 64 * 200e-6, 64 * 2e-6)
    monkeypatch.setattr(Window, "between", classmethod(lambda cls, start, end: python_work))
    # Long enough for the first look and two windows that agree, and more.
    it = iter(
        tp.range(30).interleave(_burn, cycle_length=2, num_parallel_calls=2).with_options(NO_TUNER)
    )
    out = list(it)
    assert _values(out) == _values(tp.range(30).interleave(_burn, cycle_length=2))
    assert _executor(it) == "process"
    assert {pid for *_, pid in out} - {os.getpid()}


class _Handle:
    """An input element that cannot be pickled (it holds a lock), like an open file."""

    def __init__(self, x):
        self.x = x
        self.lock = threading.Lock()


def _burn_handle(handle):
    return _burn(handle.x)


def test_readers_over_unpicklable_inputs_stay_on_threads():
    it = iter(
        tp.from_iterable(lambda: (_Handle(x) for x in range(6)))
        .interleave(_burn_handle, cycle_length=2, num_parallel_calls=2)
        .with_options(NO_TUNER)
    )
    out = list(it)
    assert _values(out) == _values(tp.range(6).interleave(_burn, cycle_length=2))
    assert _executor(it) == "thread"


def _burn_into_handles(x):
    return _burn(x).map(lambda x_, y, pid: ((x_, y), _Handle(x)))


def test_readers_of_unpicklable_elements_stay_on_threads():
    it = iter(
        tp.range(6)
        .interleave(_burn_into_handles, cycle_length=2, num_parallel_calls=2)
        .with_options(NO_TUNER)
    )
    out = [pair for pair, _ in it]
    assert out == _values(tp.range(6).interleave(_burn, cycle_length=2))
    assert _executor(it) == "thread"


def _waits(x):
    # waits, like storage
    return tp.range(x % 7 + 5).map(lambda y: (time.sleep(0.0005), (x, y, os.getpid()))[1])


def test_readers_that_mostly_wait_stay_on_threads_and_the_workers_go():
    baseline = len(psutil.Process().children(recursive=True))
    it = iter(
        tp.range(100)
        .interleave(_waits, cycle_length=2, num_parallel_calls=2)
        .with_options(NO_TUNER)
    )
    out = list(it)
    assert _executor(it) == "thread"
    assert {pid for *_, pid in out} == {os.getpid()}
    deadline = time.monotonic() + 5
    while len(psutil.Process().children(recursive=True)) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    # the zygote too, closed when threads won
    assert len(psutil.Process().children(recursive=True)) == baseline


def test_a_pass_shorter_than_the_measurement_ends_cleanly():
    it = iter(tp.range(2).interleave(_records, num_parallel_calls=2).with_options(NO_TUNER))
    assert _values(list(it)) == _values(tp.range(2).interleave(_records, cycle_length=2))
    assert _executor(it) == "thread"


def test_checkpoints_before_and_after_the_handover_resume_exactly(switch_early):
    ds = tp.range(9).interleave(
        lambda x: tp.range(x % 4 + 2), cycle_length=3, block_length=2, num_parallel_calls=2
    )
    assert_checkpoint_roundtrip(ds.with_options(NO_TUNER), positions=[0, 2, 5, 9, 14, 20])


def test_errors_arrive_in_place_across_the_handover(switch_early):
    def fragile(x):
        if x == 5:
            raise KeyError("cannot open 5")
        return tp.range(4).map(lambda y: 10 // (y - 1) if x == 7 else (x, y))

    def run(**parallel):
        return list(
            tp.range(10)
            .interleave(fragile, cycle_length=2, **parallel)
            .ignore_errors()
            .with_options(NO_TUNER)
        )

    assert run(num_parallel_calls=2) == run()
    with pytest.raises(KeyError, match="cannot open 5"):
        list(
            tp.range(10)
            .interleave(fragile, cycle_length=2, num_parallel_calls=2)
            .with_options(NO_TUNER)
        )


def test_the_knob_moves_with_the_handover(switch_early, monkeypatch):
    monkeypatch.setattr(interleave, "usable_cpu_count", lambda: 2)
    monkeypatch.setattr(process_readers, "usable_cpu_count", lambda: 2)
    ds = tp.range(10**6).interleave(_records, cycle_length=2, num_parallel_calls=tp.AUTOTUNE)
    it = iter(ds.with_options(NO_TUNER))
    next(it)
    stage = _find(it)
    (knob,) = stage.knobs()
    while _executor(it) != "process":
        next(it)
    assert stage.knobs() == [knob]  # the same object: the autotuner keeps turning it
    assert knob.value >= 2  # started where reads would keep the cores busy
    knob.request(5)
    next(it)
    readers = stage_stats(it, "interleave")
    assert list(readers["knobs"].values()) == [5]
    # 5 reads in flight: on threads, two a read (a reader's next chunk waits on one)
    assert (readers["workers"], readers["threads_per_worker"]) == (2, 6)
    knob.request(1)
    next(it)
    readers = stage_stats(it, "interleave")
    assert (readers["workers"], readers["threads_per_worker"]) == (1, 2)
    it.close()


@pytest.mark.parametrize("executor", [THREAD, PROCESS])
def test_explicit_executors_do_not_move(monkeypatch, executor):
    _verdicts(
        monkeypatch, lambda window: THREAD if executor == PROCESS else PROCESS
    )  # the policy would move them
    baseline = len(psutil.Process().children(recursive=True))
    ds = (
        tp.range(30)
        .interleave(_records, num_parallel_calls=2, executor=executor)
        .with_options(NO_TUNER)
    )
    with iter(ds) as it:
        kinds, pids = set(), set()
        for _ in it:
            kinds.add(_executor(it))
            pids.update(stage_stats(it, "interleave").get("pids", ()))
        # Counting this process's children would race with an earlier test's, which end meanwhile.
        more_children = len(psutil.Process().children(recursive=True)) > baseline
    assert kinds == {executor} and bool(pids) == (executor == PROCESS)
    assert executor == PROCESS or not more_children  # threads only: not even a zygote


@pytest.mark.parametrize("cpu_share, moves", [(0.02, False), (1.0, True)])
def test_the_executor_policy_decides_the_handover(cpu_share, moves):
    placement = ReaderPlacement(usable_cpu_count(), None)
    # 64 reads of 200 us each in 0.1 s: Python parsing (GIL held, two cores to spread it on) or
    # waiting; this thread's own time: 2 us an element.
    window = Window(0.1, 64, 64, 64 * 200e-6, 64 * 200e-6 * cpu_share, 64 * 2e-6)
    # the first window is cold, the next measures: no verdict before the threads were measured
    assert placement.verdict(window) is None and placement.verdict(window) is None
    assert placement.verdict(window) == (PROCESS if moves and usable_cpu_count() > 1 else THREAD)


def _there_and_back(window):
    """Processes for two windows, threads for two, and so on: a move every second window."""
    return PROCESS if (window - 1) // 2 % 2 == 0 else THREAD


class _LoggedStream:
    """Inner datasets over a generator, which resume by reading again from their start, that log
    every element they read to a file, from threads or processes."""

    def __init__(self, path, forever=False):
        self.path, self.forever = path, forever

    def __call__(self, x):
        path, count = self.path, None if self.forever else x % 7 + 5

        def records():
            for y in itertools.count() if count is None else range(count):
                with open(path, "a") as f:  # one short append: whole lines, whichever process
                    f.write(f"{x},{y}\n")
                yield x, y, os.getpid()

        return tp.from_iterable(records)


@pytest.mark.parametrize("logged", [_LoggedReads, _LoggedStream])
def test_readers_move_to_processes_and_back_to_threads_keeping_the_order(
    monkeypatch, tmp_path, logged
):
    """Each element is read once, either way: a reader opened in the other pool goes on after
    what it read ahead, and one the consumer took from finishes where it is (a stream, which
    resumes by reading from its start, would read again all it gave: each move, every open
    reader's elements so far)."""
    _verdicts(monkeypatch, _there_and_back)
    reads = logged(str(tmp_path / "reads"))
    ds = tp.range(40).interleave(reads, cycle_length=3, block_length=2, num_parallel_calls=3)
    it = iter(ds.with_options(NO_TUNER))
    out = list(it)
    assert _values(out) == _values(
        tp.range(40).interleave(_records, cycle_length=3, block_length=2)
    )
    here = [pid == os.getpid() for *_, pid in out]
    assert here[0] and not all(here)
    back = next(
        k for k in range(1, len(here)) if here[k] and not here[k - 1]
    )  # read here again after a worker
    assert back < len(here)
    lines = (tmp_path / "reads").read_text().splitlines()
    # each element read once, either way
    assert sorted(lines) == sorted(f"{x},{y}" for x, y in _values(out))


def test_readers_still_reading_where_they_were_after_the_drain_time_move_too(monkeypatch):
    """Readers that stay after a move go over too once ``DRAIN_S`` passed (an inner dataset that
    never ends must not hold the other pool up): in their places, nothing lost or repeated."""
    _verdicts(monkeypatch, lambda window: PROCESS)
    monkeypatch.setattr(interleave_iterator, "DRAIN_S", 0.0)
    ds = tp.range(30).interleave(_records, cycle_length=3, block_length=2, num_parallel_calls=3)
    it = iter(ds.with_options(NO_TUNER))
    out = list(it)
    assert _values(out) == _values(
        tp.range(30).interleave(_records, cycle_length=3, block_length=2)
    )
    assert out[-1][2] != os.getpid() and _executor(it) == "process"


def test_a_pass_closed_while_readers_of_endless_streams_stay_stops_both_pools(
    monkeypatch, tmp_path
):
    _verdicts(monkeypatch, lambda window: PROCESS)
    reads = _LoggedStream(str(tmp_path / "reads"), forever=True)
    ds = tp.range(4).interleave(reads, cycle_length=2, num_parallel_calls=2).take(60)
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' leftovers
    it = iter(ds.with_options(NO_TUNER))
    out = list(it)
    assert _values(out) == [(x, y) for y in range(30) for x in (0, 1)]
    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert children  # the worker processes (and their zygote) the readers moved to
    it.close()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_checkpoints_resume_exactly_while_readers_move_both_ways(monkeypatch):
    _verdicts(monkeypatch, _there_and_back)
    ds = tp.range(12).interleave(
        lambda x: tp.range(x % 4 + 2), cycle_length=3, block_length=2, num_parallel_calls=2
    )
    assert_checkpoint_roundtrip(ds.with_options(NO_TUNER), positions=[0, 4, 9, 15, 22, 30, 36])


def test_the_non_deterministic_order_holds_while_readers_move_both_ways(monkeypatch):
    _verdicts(monkeypatch, _there_and_back)
    ds = tp.range(30).interleave(
        _records, cycle_length=3, num_parallel_calls=3, deterministic=False
    )
    out = list(ds.with_options(NO_TUNER))
    assert sorted(_values(out)) == sorted(
        _values(tp.range(30).interleave(_records, cycle_length=3))
    )


class _Clock:
    """Stands in for time.perf_counter in the placement, moved on by hand."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(reader_placement, "time", fake)
    return fake


def _run(placement, stats, clock, seconds, elements, wall, cpu, reads=None):
    """``elements`` delivered in ``seconds``, each read (as many as elements, or ``reads``)
    taking ``wall`` and ``cpu`` seconds; what the placement says at the end."""
    clock.now += seconds
    stats.produced += elements
    reads = elements if reads is None else reads
    stats.calls.add(wall * reads, cpu * reads, calls=reads, items=reads)
    stats.clocked(elements * 2e-6)  # this thread's own time: 2 us an element
    return placement.review(stats)


def _stats():
    stats = IteratorStats()
    stats.calls = CallTiming()
    return stats


PARSING, CHEAP = (200e-6, 200e-6), (0.5e-6, 0.5e-6)  # a read's wall and CPU seconds


WAITING = (400e-6, 8e-6)


def test_a_move_waits_for_two_windows_and_processes_measured_slower_send_the_readers_back(clock):
    placement, stats = ReaderPlacement(2, None), _stats()
    assert _run(placement, stats, clock, 0.01, 16, *PARSING) is None  # the first look
    assert _run(placement, stats, clock, 0.1, 64, *PARSING) is None  # processes, once
    assert _run(placement, stats, clock, 0.1, 64, *WAITING) is None  # threads: no two agree yet
    assert _run(placement, stats, clock, 0.1, 64, *PARSING) is None
    assert _run(placement, stats, clock, 0.1, 64, *PARSING) == PROCESS  # twice: move
    placement.moved(PROCESS, stats.produced + 100)
    assert not placement.deciding and placement.kind == PROCESS
    assert _run(placement, stats, clock, 0.3, 64, *PARSING) is None  # a cycle not yet delivered
    # settled: the first window starts
    assert _run(placement, stats, clock, 0.1, 64, *PARSING) is None
    # half the threads' rate: the first window is not counted, then two are needed
    for _ in range(3):
        assert _run(placement, stats, clock, 0.2, 64, *PARSING) is None
    assert _run(placement, stats, clock, 0.2, 64, *PARSING) == THREAD  # and two verdicts
    placement.moved(THREAD)
    for _ in range(6):  # threads measured faster than processes: they stay, and nothing is tried
        assert _run(placement, stats, clock, 0.1, 64, *PARSING) is None
    assert not placement.settled  # the worker processes stay ready: measurements may change


def test_a_busy_moment_moves_nothing(clock):
    placement, stats = ReaderPlacement(2, None), _stats()
    _run(placement, stats, clock, 0.01, 16, *PARSING)
    verdicts = [
        _run(placement, stats, clock, 0.1, 64, *reads)
        for reads in (PARSING, WAITING, PARSING, PARSING)
    ]
    assert verdicts == [None, None, None, PROCESS]
    placement.moved(PROCESS)
    _run(placement, stats, clock, 0.3, 64, *PARSING)
    for seconds in [
        0.1,
        0.1,
        0.1,
        0.5,
        0.5,
        0.1,
        0.1,
    ]:  # two windows 5x slower: a measure is a median
        assert _run(placement, stats, clock, seconds, 64, *PARSING) is None


def test_readers_the_first_verdict_keeps_on_threads_stay_there(clock):
    placement, stats = ReaderPlacement(2, None), _stats()
    _run(placement, stats, clock, 0.01, 16, *WAITING)
    for _ in range(2):  # the cold window, then the threads' measure
        assert _run(placement, stats, clock, 0.1, 64, *WAITING) is None and placement.deciding
        assert not placement.settled
    assert _run(placement, stats, clock, 0.1, 64, *WAITING) is None and not placement.settled
    assert _run(placement, stats, clock, 0.1, 64, *WAITING) is None and placement.settled


def _moved_to_processes(clock):
    """Readers that parse, measured on threads, moved to processes by the model's word."""
    placement, stats = ReaderPlacement(2, None), _stats()
    _run(placement, stats, clock, 0.01, 16, *PARSING)
    for _ in range(3):
        _run(placement, stats, clock, 0.1, 64, *PARSING)
    assert _run(placement, stats, clock, 0.1, 64, *PARSING) == PROCESS
    placement.moved(PROCESS)
    return placement, stats


def _on_processes(clock):
    """:func:`_moved_to_processes`, and the first window there (settled)."""
    placement, stats = _moved_to_processes(clock)
    _run(placement, stats, clock, 0.3, 64, *PARSING)
    return placement, stats


def test_reads_that_get_cheap_on_processes_send_the_readers_back_after_two_windows(clock):
    placement, stats = _on_processes(clock)
    for _ in range(4):  # faster than threads: stays (cold, two to measure, one watched)
        assert _run(placement, stats, clock, 0.06, 64, *PARSING) is None
    # The workload changes: a read costs 400x less (records already in memory), and receiving one
    # from a worker costs twice what reading it here does. Measured times from before no longer count.
    assert _run(placement, stats, clock, 0.06, 64, *CHEAP) is None  # once: could be a blip
    assert _run(placement, stats, clock, 0.06, 64, *CHEAP) == THREAD


def test_the_windows_while_the_pool_moved_to_ramps_up_are_not_its_measure(clock):
    """The pool the readers moved to starts its reads in flight and fills its read-ahead: what it
    delivers in its first 0.3 s (here a fifth of the threads' rate) is not its measure, and at
    the threads' rate after that the readers stay (they went back to threads on it)."""
    placement, stats = _moved_to_processes(clock)
    # reading ahead, it delivers an eighth of what it reads
    verdicts = [_run(placement, stats, clock, 0.035, 8, *PARSING, reads=64) for _ in range(8)]
    verdicts += [_run(placement, stats, clock, 0.1, 64, *PARSING) for _ in range(6)]
    assert THREAD not in verdicts and placement.kind == PROCESS


def test_the_costly_windows_after_a_move_keep_what_the_threads_measured(clock):
    """Readers re-read to where they were after a move: the first windows on processes cost many
    times a read's CPU. That is not a new workload: the threads' measure stands, and processes
    measured 3x slower than it send the readers back (the model alone would keep them there)."""
    placement, stats = _on_processes(clock)
    re_reading = (PARSING[0] * 10, PARSING[1] * 10)
    verdicts = [_run(placement, stats, clock, 0.5, 64, *re_reading) for _ in range(2)]
    verdicts += [_run(placement, stats, clock, 0.3, 64, *PARSING) for _ in range(4)]
    assert THREAD in verdicts

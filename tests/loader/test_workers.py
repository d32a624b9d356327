"""``DataLoader(num_workers="auto")``: the policy places a map-style dataset's batches (this process,
threads or worker processes) and the autotuner sizes the pool."""

import os
import random
import threading
import time

import numpy as np
import psutil
import pytest
import torch

import torchpipe as tp
from torchpipe.autotune.autotuner import Autotuner, ConsumerClock
from torchpipe.autotune.live import Counters, Look
from torchpipe.autotune.tuner import Budget
from torchpipe.loader.workers import NOT_ON_THREADS, WorkerIterator
from torchpipe.randomness import seeds_were_set
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.placement.costs import INLINE, PROCESS, THREAD
from torchpipe.testing import forced_call_costs, knobs, move_calls, stages


class Sleepy(torch.utils.data.Dataset):
    """Items that wait (as on a disk or the network) rather than compute."""

    def __init__(self, n, seconds=0.0):
        self.n, self.seconds = n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.seconds:
            time.sleep(self.seconds)
        info = torch.utils.data.get_worker_info()  # None in this process (inline or on threads)
        return torch.tensor([i, -1, 0] if info is None else [i, info.id, info.num_workers])


def _workers(loader, it):
    return loader.stats()[0]["knobs"]["num_workers"]


def _pids(loader):
    """The loader's worker processes, as its stats name them."""
    return loader.stats()[0]["pids"]


def _executor(loader):
    """Where the loader's batches are made now, as its stats say: inline, thread or process."""
    return loader.stats()[0]["knobs"]["executor"]


def test_moving_between_this_process_threads_and_processes_mid_epoch_loses_repeats_and_reorders_no_batch():
    loader = tp.DataLoader(Sleepy(400), batch_size=4, num_workers="auto")
    # Only the moves below move the calls: on a loaded machine the windows' own verdicts (a worker
    # process's first batches, slow to come, lose big to batches made here) moved them back first.
    with forced_call_costs(1e-3, gil_free=1.0, moves=False):
        it = iter(loader)
        assert isinstance(it, WorkerIterator) and "resized by the autotuner" in tp.explain(loader)
        seen = [next(it) for _ in range(5)]
        kinds = set()
        for kind, size in (
            (PROCESS, 2),
            (INLINE, 0),
            (THREAD, 3),
            (PROCESS, 3),
            (PROCESS, 1),
            (INLINE, 0),
        ):
            move_calls(it, kind, size)  # what the policy's and the tuner's decisions do
            seen.extend(next(it) for _ in range(8))
            kinds.add(loader.stats()[0]["knobs"]["executor"])
            assert _workers(loader, it) == size
            if kind == PROCESS:
                assert len(_pids(loader)) == size
        seen.extend(it)
    items = torch.cat(seen)
    assert items[:, 0].tolist() == list(range(400))
    most = max(usable_cpu_count(), 2 * usable_cpu_count())
    from_workers = items[items[:, 1] >= 0]
    assert len(from_workers) and set(from_workers[:, 2].tolist()) == {
        most
    }  # get_worker_info(): the most there may be
    assert from_workers[:, 1].max() < most and kinds == {INLINE, THREAD, PROCESS}


def test_cheap_batches_are_made_in_this_process_and_the_tuners_zero_means_that():
    loader = tp.DataLoader(Sleepy(100_000), batch_size=4, num_workers="auto")
    # what cheap batches measure on an idle machine
    with forced_call_costs(5e-6, gil_free=0.0, move_s=1e-4):
        it = iter(loader)
    first, deadline = [], time.monotonic() + 10
    # it may try the others first
    while _executor(loader) != INLINE and time.monotonic() < deadline:
        first.append(next(it))
    first += [next(it) for _ in range(100)]
    assert _executor(loader) == INLINE and _workers(loader, it) == 0 and _pids(loader) == []
    (knob,) = knobs(it)
    knob.request(2)  # the tuner asks for a pool: the best parallel executor gets it
    rest = [next(it)]
    assert _workers(loader, it) == 2 and _executor(loader) != INLINE
    rest += [next(it) for _ in range(99)]
    assert torch.cat(first + rest)[:, 0].tolist() == list(range(4 * (len(first) + 100)))


def test_the_next_epoch_starts_where_the_last_one_left_the_batches():
    loader = tp.DataLoader(Sleepy(40), batch_size=4, num_workers="auto")
    it = iter(loader)
    next(it)
    move_calls(it, PROCESS, 3)
    rest = list(it)
    assert len(rest) == 9 and _workers(loader, it) == 3
    again = iter(loader)  # a new epoch (workers are not persistent): no measuring again
    assert _executor(loader) == PROCESS and _workers(loader, again) == 3 and len(_pids(loader)) == 3
    rest = list(again)
    assert torch.cat(rest)[:, 0].tolist() == list(range(40))


def test_epochs_shorter_than_a_window_still_revise_the_placement_within_two_epochs():
    """Persistent workers, epochs of a few ms: each epoch's end closes a window, so a placement
    that measures worse (cheap batches sent to processes) is revised by the second epoch's end.
    Epochs of 16 batches: after the move, the batches in flight and each worker's first two are
    not judged, so at most one window fits in the first epoch (a move needs two that agree),
    however slow a loaded machine makes it."""
    loader = tp.DataLoader(Sleepy(64), batch_size=4, num_workers="auto", persistent_workers=True)
    it = iter(loader)
    first = [next(it)]
    move_calls(it, PROCESS, 2)  # a first decision that cheap batches cannot repay
    epochs = [first + list(it)]
    assert _executor(loader) == PROCESS
    epochs += [list(loader) for _ in range(2)]
    # judged at the end of each epoch, agreed at the second's: off processes (here, or on threads:
    # for these batches the two measure within noise of each other on a loaded machine)
    assert _executor(loader) in (INLINE, THREAD)
    epochs.append(list(loader))
    assert loader.stats()[0]["executor"] in (INLINE, THREAD)
    for batches in epochs:
        assert torch.cat(batches)[:, 0].tolist() == list(range(64))


def test_epochs_that_make_cheap_batches_here_fork_no_process():
    """The zygote is forked when batches first go to processes: not in an epoch whose first
    decision keeps them here, nor (each epoch gets a new pool without persistent workers) in one
    after it while processes are predicted no better (~10 ms and its memory an epoch)."""
    loader = tp.DataLoader(Sleepy(2000), batch_size=4, num_workers="auto")
    before = {p.pid for p in psutil.Process().children()}  # other tests' processes may linger
    # what cheap batches measure on an idle machine
    with forced_call_costs(5e-6, gil_free=0.0, move_s=1e-4):
        it = iter(loader)
        first = [next(it)]
    assert _executor(loader) == INLINE and {p.pid for p in psutil.Process().children()} == before
    first += list(it)
    it = iter(loader)
    rest = [next(it)]
    forked = {
        p.pid for p in psutil.Process().children()
    } - before  # mid-epoch: a zygote would be alive
    rest += list(it)
    assert _executor(loader) in (INLINE, THREAD) and forked == set()
    for batches in (first, rest):
        assert torch.cat(batches)[:, 0].tolist() == list(range(2000))


class Augmented(torch.utils.data.Dataset):
    """Random augmentation from the global RNGs, as torchvision transforms draw it; the last column
    says whether the item was made on one of this process's threads."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        on_thread = (
            os.getpid() == MAIN_PID and threading.current_thread() is not threading.main_thread()
        )
        return torch.tensor(
            [i, random.random(), float(np.random.rand()), float(torch.rand(())), on_thread]
        )


MAIN_PID = os.getpid()
UNTUNED = tp.AutotuneOptions(enabled=False)  # the test plays the tuner
STARTUP_SEED = 2**63 + 12345
"""A seed as torch gives its default generator at start-up (random, 64 bits): no one set seeds."""


@pytest.mark.parametrize("kind, workers", [(INLINE, 0), (PROCESS, 1), (PROCESS, 3)])
def test_auto_augmentation_is_the_same_wherever_a_batch_is_made(kind, workers):
    def epoch(move_to):
        torch.manual_seed(7)
        loader = tp.DataLoader(Augmented(), batch_size=4, num_workers="auto", shuffle=True)
        it = iter(loader)
        out = [next(it)]
        if move_to is not None:
            move_calls(it, *move_to)
        return torch.cat(out + list(it))

    with torch.random.fork_rng():
        reference = epoch(None)
        assert torch.equal(epoch((kind, workers)), reference)
    assert not torch.equal(reference[:, 1], reference[:, 1].sort().values)  # shuffled, and random


def test_seeds_count_as_set_with_a_generator_or_a_default_seed_below_2_to_the_32():
    with torch.random.fork_rng():
        torch.manual_seed(STARTUP_SEED)
        assert not seeds_were_set(None) and seeds_were_set(torch.Generator())
        for seed in (0, 42, 2**32 - 1):
            torch.manual_seed(seed)
            assert seeds_were_set(None)


@pytest.mark.parametrize("seeded_by", ["generator", "torch.manual_seed"])
def test_with_seeds_set_a_dataset_that_draws_never_runs_on_threads_and_repeats_exactly(seeded_by):
    def epoch():
        with torch.random.fork_rng():
            torch.manual_seed(0 if seeded_by == "torch.manual_seed" else STARTUP_SEED)
            generator = torch.Generator().manual_seed(0) if seeded_by == "generator" else None
            loader = tp.DataLoader(
                Augmented(), batch_size=4, num_workers="auto", shuffle=True, generator=generator
            )
            return torch.cat(list(loader)), loader.stats()[0]

    first, entry = epoch()
    again, _ = epoch()
    assert torch.equal(first, again) and not first[:, 4].any()
    assert entry["not_on_threads"] == NOT_ON_THREADS and THREAD not in entry["measured"]
    # what the policy measured: the first calls' costs, and each executor it ran on
    assert entry["policy"]["costs"]["call_s"] > 0 and entry["policy"]["costs"]["nbytes"] >= 0
    assert set(entry["policy"]["measured_s"]) == set(entry["measured"])


def test_without_seeds_a_dataset_that_draws_may_run_on_threads_and_loses_or_repeats_no_index():
    with torch.random.fork_rng():
        torch.manual_seed(STARTUP_SEED)
        loader = tp.DataLoader(Augmented(), batch_size=4, num_workers="auto")
        it = iter(loader)
        batches = [next(it)]
        assert "not_on_threads" not in loader.stats()[0]  # the policy may choose threads
        move_calls(it, THREAD, 3)  # as it would for items that release the GIL
        batches += list(it)
    assert [b[:, 0].tolist() for b in batches] == [list(range(k, k + 4)) for k in range(0, 64, 4)]
    assert torch.cat(batches)[:, 4].any() and "not_on_threads" not in loader.stats()[0]


def test_stats_say_the_most_worker_processes_a_run_held_its_trials_and_earlier_epochs_included():
    """A run's memory at its peak is what its most worker processes held (a trial of processes
    holds what torch's workers hold), whatever it ends on: stats() keep that count from pass to
    pass, as the bench's memory verdicts read it."""
    loader = tp.DataLoader(Sleepy(64), batch_size=2, num_workers="auto", persistent_workers=True)
    with forced_call_costs(1e-3, gil_free=1.0, moves=False):  # held where the test moves them
        it = iter(loader)
        first = [next(it)]
        assert loader.stats()[0]["most_processes"] == 0  # none forked yet
        move_calls(it, PROCESS, 2)
        first += list(it)
        assert loader.stats()[0]["most_processes"] == 2
        it = iter(loader)  # the next epoch, back in this process
        move_calls(it, INLINE, 0)
        second = list(it)
    entry = loader.stats()[0]
    assert entry["executor"] == INLINE and entry["most_processes"] == 2
    assert torch.cat(first)[:, 0].tolist() == torch.cat(second)[:, 0].tolist() == list(range(64))
    assert (torch.cat(first)[:, 1] >= 0).any() and second[-1][0, 1] == -1  # then inline


def test_fixed_workers_and_iterable_datasets_are_not_tuned():
    fixed = tp.DataLoader(Sleepy(8), num_workers=2)
    iter(fixed)
    assert "autotuner" not in tp.explain(fixed)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    stream = tp.DataLoader(Stream(), num_workers="auto")
    iter(stream)
    assert "autotuner" not in tp.explain(stream)


def _window(stage, batches, seconds, work_s, consumer_s):
    """Two looks ``seconds`` apart: ``batches`` delivered, the workers busy ``work_s`` in all."""
    before = Look(0.0, {id(stage): Counters()}, 0.0, 0.0)
    after = Look(
        seconds,
        {
            id(stage): Counters(
                produced=batches,
                wall_s=seconds - consumer_s,
                wait_s=seconds - consumer_s - 0.01,
                calls=batches,
                work_s=work_s,
                cpu_s=0.1 * work_s,
            )
        },
        consumer_s,
        0.0,
    )
    return before, after


@pytest.mark.parametrize(("work_s", "consumer_s", "grows"), [(1.0, 0.05, True), (0.2, 0.95, False)])
def test_the_tuner_adds_workers_only_when_the_loop_waits_for_them(work_s, consumer_s, grows):
    """Simulated windows of 50 batches on 2 workers, mostly waiting: either the workers take 20 ms
    a batch and the loop 1 ms (it waits on them: add some), or they take 4 ms and the loop 19 ms
    (it is the limit: do not)."""
    loader = tp.DataLoader(Sleepy(1000), batch_size=4, num_workers="auto", autotune=UNTUNED)
    it = iter(loader)
    next(it)
    move_calls(it, THREAD, 2)
    (stage,), (knob,) = stages(it), knobs(it)
    tuner = Autotuner(stage, ConsumerClock(), Budget(cpu=2.0, ram=1e9))
    decision = tuner.step(
        *_window(stage, batches=50, seconds=1.0, work_s=work_s, consumer_s=consumer_s)
    )
    knob.take_request()  # what the iterator does before its next batch
    assert decision.bottleneck == ("DataLoader workers (calls)" if grows else "consumer")
    if grows:
        # at most doubled in a round
        assert 2 < knob.value <= 4 and _workers(loader, it) == knob.value
    else:
        assert knob.value <= 2


def test_batches_that_wait_on_io_get_many_workers_and_keep_their_order():
    loader = tp.DataLoader(Sleepy(100_000, seconds=0.005), batch_size=4, num_workers="auto")
    it = iter(loader)
    seen = [next(it) for _ in range(60)]
    assert _executor(loader) in (THREAD, PROCESS) and _workers(loader, it) > usable_cpu_count()
    assert torch.cat(seen)[:, 0].tolist() == list(range(4 * len(seen)))


def test_auto_shuffles_every_epoch_as_torch_does():
    # The sampler draws each epoch's seed from torch's global RNG; the first decision's measured
    # batches must not put that draw back, or later epochs' orders part from torch's.
    def epochs(loader_class, **kwargs):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            loader = loader_class(list(range(22)), batch_size=4, shuffle=True, **kwargs)
            return [[batch.tolist() for batch in loader] for _ in range(3)]

    assert epochs(tp.DataLoader, num_workers="auto") == epochs(torch.utils.data.DataLoader)


def test_auto_batches_made_inline_read_the_cpu_clock_one_in_a_few(monkeypatch):
    """#59 item 2: where the policy makes batches in this process, a cheap batch costs the plain
    loop and a bounded constant: the wall clock around each call, the CPU clock (two reads, ~1.5
    us) one batch in 16 (runtime/timing.py's SampledCalls), every batch counted."""
    from torchpipe.runtime import timing as timing_module

    reads = [0]
    real = time.thread_time

    class Clocks:
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def thread_time():
            reads[0] += 1
            return real()

    loader = tp.DataLoader(Sleepy(10_000), batch_size=2, num_workers="auto", autotune=UNTUNED)
    it = iter(loader)
    next(it)
    move_calls(it, INLINE, 0)
    next(it)  # the first call inline is clocked
    monkeypatch.setattr(timing_module, "time", Clocks)
    calls_before = it._pool.timing.calls
    n = 640
    batches = [next(it) for _ in range(n)]
    assert _executor(loader) == INLINE and len(batches) == n
    # ~80 expected; 1280 when every batch was clocked
    assert reads[0] <= 2 * 3 * n / timing_module.SAMPLE_EVERY
    counted = it._pool.timing.calls - calls_before
    assert n - 20 * timing_module.SAMPLE_EVERY <= counted <= n + 1

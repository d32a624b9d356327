"""``DataLoader(num_workers="auto")``: the autotuner sizes the worker pool of a map-style dataset."""

import time

import pytest
import torch

import torchpipe as tp
from torchpipe.autotune.live import Counters, Look
from torchpipe.autotune.runner import Autotuner, ConsumerClock
from torchpipe.autotune.tuner import Budget
from torchpipe.loader_workers import WorkerIterator, _WorkersStage
from torchpipe.ops.stats import LiveKnob
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.timing import CallTiming


class Sleepy(torch.utils.data.Dataset):
    """Items that wait (as on a disk or the network) rather than compute."""

    def __init__(self, n, seconds=0.0):
        self.n, self.seconds = n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.seconds:
            time.sleep(self.seconds)
        info = torch.utils.data.get_worker_info()
        return torch.tensor([i, info.id, info.num_workers])


def _workers(loader, it):
    return loader.stats()[0]["knobs"]["num_workers"]


def test_resizing_mid_epoch_loses_repeats_and_reorders_no_batch():
    loader = tp.DataLoader(Sleepy(200), batch_size=4, num_workers="auto")
    it = iter(loader)
    assert isinstance(it, WorkerIterator) and it._knob is not None
    seen = [next(it) for _ in range(5)]
    for size in (1, 3, 2):  # what the tuner's requests do, applied between two batches
        it._knob.request(size)
        seen.extend(next(it) for _ in range(5))
        assert _workers(loader, it) == size == len(it._pool.pids)
    seen.extend(it)
    items = torch.cat(seen)
    assert items[:, 0].tolist() == list(range(200))
    most = max(usable_cpu_count(), 2 * usable_cpu_count())
    assert set(items[:, 2].tolist()) == {most}  # get_worker_info().num_workers: the most there may be
    assert items[:, 1].max() < most


def test_the_next_epoch_starts_with_the_workers_the_tuner_left():
    loader = tp.DataLoader(Sleepy(40), batch_size=4, num_workers="auto")
    it = iter(loader)
    assert len(it._pool.pids) == usable_cpu_count()
    next(it)
    it._knob.request(3)
    rest = list(it)
    assert len(rest) == 9 and _workers(loader, it) == 3
    again = iter(loader)  # a new epoch (workers are not persistent): no climb from the cores again
    assert len(again._pool.pids) == 3 and again._knob.value == 3
    assert torch.cat(list(again))[:, 0].tolist() == list(range(40))


def test_fixed_workers_and_iterable_datasets_are_not_tuned():
    assert iter(tp.DataLoader(Sleepy(8), num_workers=2))._knob is None

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    assert iter(tp.DataLoader(Stream(), num_workers="auto"))._knob is None


class _Pool:
    """What the workers' stage reads of a pool: its size and its workers' timing."""

    def __init__(self, size):
        self.size, self.timing = size, CallTiming()


def _window(stage, batches, seconds, work_s, consumer_s):
    """Two looks ``seconds`` apart: ``batches`` delivered, the workers busy ``work_s`` in all."""
    before = Look(0.0, {id(stage): Counters()}, 0.0, 0.0)
    after = Look(seconds, {id(stage): Counters(produced=batches, wall_s=seconds - consumer_s,
                                               wait_s=seconds - consumer_s - 0.01, calls=batches,
                                               work_s=work_s, cpu_s=0.1 * work_s)},
                 consumer_s, 0.0)  # fmt: skip
    return before, after


@pytest.mark.parametrize(("work_s", "consumer_s", "grows"), [(1.0, 0.05, True), (0.2, 0.95, False)])
def test_the_tuner_adds_workers_only_when_the_loop_waits_for_them(work_s, consumer_s, grows):
    """Simulated windows of 50 batches on 2 workers, mostly waiting: either the workers take 20 ms
    a batch and the loop 1 ms (it waits on them: add some), or they take 4 ms and the loop 19 ms
    (it is the limit: do not)."""
    requested = []
    knob = LiveKnob("DataLoader workers.parallelism", 2, 1, 8, False, requested.append)
    stage = _WorkersStage(_Pool(2), 2, knob)
    tuner = Autotuner(stage, ConsumerClock(), Budget(cpu=2.0, ram=1e9))
    decision = tuner.step(*_window(stage, batches=50, seconds=1.0, work_s=work_s, consumer_s=consumer_s))
    knob.take_request()  # what the iterator does before its next batch
    assert decision.bottleneck == ("DataLoader workers (calls)" if grows else "consumer")
    if grows:
        assert requested and 2 < requested[-1] <= 4  # at most doubled in a round
    else:
        assert not requested or requested[-1] <= 2


def test_the_tuner_thread_adds_workers_to_a_loop_that_waits():
    loader = tp.DataLoader(Sleepy(100_000, seconds=0.005), batch_size=4, num_workers="auto")
    it = iter(loader)
    start = _workers(loader, it)
    deadline = time.monotonic() + 20
    seen = []
    while _workers(loader, it) <= start and time.monotonic() < deadline:
        seen.append(next(it))
    assert _workers(loader, it) > start
    assert loader.stats().decisions
    seen.extend(next(it) for _ in range(20))
    assert torch.cat(seen)[:, 0].tolist() == list(range(4 * len(seen)))

"""num_workers="auto" over an IterableDataset: replicas placed on processes, torch's batches wherever they run."""

import os
import random
import signal
import time

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import torchpipe as tp
from torchpipe.loader.replicas import ReplicaPlan
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.testing import assert_same_elements, forced_call_costs, start_as_measured

REPLICAS = 2 * usable_cpu_count()
# torch's, for its many workers
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Shares(IterableDataset):
    """Each replica yields its share of ``range(n)`` with draws from every global RNG, waiting
    ``wait_s`` before each element (slow storage) if asked to."""

    def __init__(self, n=60, wait_s=0.0):
        self.n, self.wait_s = n, wait_s

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            if self.wait_s:
                time.sleep(self.wait_s)
            yield {
                "i": i,
                "replica": info.id,
                "of": info.num_workers,
                "draws": torch.tensor([random.random(), float(torch.rand(()))]),
            }


def loaders(dataset, processes=None, replicas=REPLICAS, **kwargs):
    """torch's DataLoader with one worker a replica, and torchpipe's with ``"auto"`` (``replicas``
    of them, on ``processes`` processes where given, as a loader that measured before would place them)."""
    theirs = torch.utils.data.DataLoader(
        dataset, num_workers=replicas, generator=torch.Generator().manual_seed(5), **kwargs
    )
    ours = tp.DataLoader(
        dataset, num_workers="auto", generator=torch.Generator().manual_seed(5), **kwargs
    )
    start_as_measured(ours, processes, replicas)
    return theirs, ours


# every replica in one process; measured (spread: they wait)
@pytest.mark.parametrize("processes", [1, None])
def test_batches_are_torchs_with_a_worker_a_replica_wherever_replicas_run(processes):
    theirs, ours = loaders(Shares(wait_s=0.002), processes, batch_size=4)
    # batches that wait, whatever the load
    with forced_call_costs(call_s=0.01, gil_free=1.0, cpu_s=0.0005, moves=False):
        got = list(iter(ours))
    # same order, same draws: each replica keeps its RNG states
    assert_same_elements(got, list(theirs))
    assert sorted(int(i) for b in got for i in b["i"]) == list(range(60))
    assert {int(n) for b in got for n in b["of"]} == {REPLICAS}
    # Where it ran is decided, not measured: start_as_measured's processes, else the forced costs (calls
    # that wait: a process a replica), which no window moves; threads are out for replicas that draw
    # from seeded global RNGs.
    made_by = ours.stats()[0]
    assert (made_by["executor"], made_by["workers"]) == (
        "process",
        processes or REPLICAS,
    )  # waits: a process a replica


def _of(batches):
    return {int(n) for b in batches for n in b["of"]}


def test_replicas_that_wait_start_the_first_epoch_over_with_more_and_keep_them():
    ours = tp.DataLoader(
        Shares(200, wait_s=0.002),
        num_workers="auto",
        batch_size=4,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(5),
    )
    first = list(ours)
    (count,) = _of(first)  # every delivered batch from the final count
    assert REPLICAS < count <= 64
    # nothing lost or repeated
    assert sorted(int(i) for b in first for i in b["i"]) == list(range(200))
    assert ours.stats()[0]["workers"] == count  # a process a replica
    theirs = torch.utils.data.DataLoader(
        Shares(200, wait_s=0.002),
        num_workers=count,
        batch_size=4,
        generator=torch.Generator().manual_seed(5),
    )
    assert_same_elements(first, list(theirs))  # torch's batches with that many workers
    assert _of(ours) == {count}  # the next epoch starts with it
    assert f"running {count} replicas, one a process where they wait" in tp.explain(ours)


def test_a_state_taken_after_the_start_over_resumes_with_its_replicas():
    def make():
        return tp.DataLoader(
            Shares(120, wait_s=0.002),
            num_workers="auto",
            batch_size=4,
            generator=torch.Generator().manual_seed(5),
        )

    loader, delivered = make(), []
    for batch in loader:
        delivered.append(batch)
        if len(delivered) == 7:
            state = loader.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    # the count the state's epoch ran
    assert _of(rest) == _of(delivered) == {state["loader"]["replicas"]}
    assert sorted(int(i) for b in delivered + rest for i in b["i"]) == list(range(120))


def test_busy_replicas_keep_the_count_and_share_a_process_a_core():
    ours = tp.DataLoader(Shares(200), num_workers="auto", batch_size=4)
    assert (
        f"running {REPLICAS} replicas ({min(64, 8 * usable_cpu_count())} where the first batches wait on I/O)"
        in (tp.explain(ours))
    )
    # busy batches, whatever else runs on this machine
    with forced_call_costs(call_s=0.01, gil_free=0.0):
        assert _of(ours) == {REPLICAS}
    assert ours.stats()[0]["workers"] == usable_cpu_count()


def _split_by_init(worker_id):
    # torch's documented pattern: worker_init_fn narrows its worker's copy of the dataset
    info = get_worker_info()
    info.dataset.start = worker_id * 10


class Ranged(IterableDataset):
    start = 0

    def __iter__(self):
        for i in range(10):
            yield self.start + i  # read as it goes: another replica's set-up must not move it


def test_worker_init_fn_sets_up_each_replica_alone_in_a_shared_process():
    theirs, ours = loaders(Ranged(), processes=1, batch_size=5, worker_init_fn=_split_by_init)
    got = [b.tolist() for b in ours]
    assert got == [b.tolist() for b in theirs]
    assert sorted(x for b in got for x in b) == list(range(10 * REPLICAS))


def test_persistent_workers_give_torchs_epochs():
    theirs, ours = loaders(Shares(24), processes=1, batch_size=3, persistent_workers=True)
    for _ in range(2):
        assert_same_elements(list(ours), list(theirs))


def test_the_plan_waits_for_a_measurement_then_spreads_waiting_replicas_and_shares_busy_ones():
    plan = ReplicaPlan(replicas=4, processes=2)
    assert [plan.host(r) for r in range(4)] == [0, 1, None, None]
    assert (
        plan.decide(calls=2, wall_s=0.020, cpu_s=0.019, cores=2) is None
    )  # busy: a process a core
    assert [plan.host(r) for r in range(4)] == [0, 1, 0, 1]
    waiting = ReplicaPlan(replicas=4, processes=2, fixed=True)  # a count an earlier epoch chose
    assert waiting.decide(calls=2, wall_s=0.020, cpu_s=0.002, cores=2) is None  # mostly waiting
    assert [waiting.host(r) for r in range(4)] == [0, 1, 2, 3]
    assert ReplicaPlan(replicas=4, processes=2, decided=3).host(3) == 0  # an earlier epoch decided


def test_the_first_plan_asks_for_more_replicas_where_batches_wait_within_the_room():
    assert ReplicaPlan(4, 2).decide(calls=2, wall_s=0.020, cpu_s=0.002, cores=2) == 16  # 8 a core
    assert (
        ReplicaPlan(4, 2).decide(calls=2, wall_s=0.200, cpu_s=0.002, cores=2) == 16
    )  # whatever the waits
    assert (
        ReplicaPlan(32, 16).decide(calls=16, wall_s=0.16, cpu_s=0.016, cores=16) == 64
    )  # at most 64
    assert (
        ReplicaPlan(4, 2).decide(calls=2, wall_s=0.020, cpu_s=0.002, cores=2, room=9) == 9
    )  # the RAM budget's
    assert (
        ReplicaPlan(4, 2).decide(calls=2, wall_s=0.020, cpu_s=0.002, cores=2, room=3) is None
    )  # fewer: keep


class Tagged(IterableDataset):
    """Its share of ``range(n)``, each element with the pid that made it; ``shorter_after_restart``:
    a replica started in a process other than the first yields a tenth as much (a stream that
    cannot be replayed)."""

    def __init__(self, n=1200, shorter_after_restart=None):
        self.n, self.marker = n, shorter_after_restart

    def __iter__(self):
        info = get_worker_info()
        n = self.n
        if self.marker is not None:
            if os.path.exists(self.marker):
                n //= 10
            open(self.marker, "w").close()
        for i in range(info.id, n, info.num_workers):
            yield i, os.getpid()


def _kill_at(loader, at):
    """Every batch of ``loader``, the worker that made batch ``at`` killed when it arrives."""
    batches = []
    for k, (x, pid) in enumerate(loader):
        batches.append(x)
        if k == at:
            os.kill(int(pid[0]), signal.SIGKILL)
    return batches


@pytest.mark.parametrize("workers", [2, "auto"])
def test_a_killed_workers_replica_is_replayed_past_what_it_delivered(workers):
    def make():
        return tp.DataLoader(
            Tagged(), batch_size=8, num_workers=workers, generator=torch.Generator().manual_seed(1)
        )

    # "auto" decides the replica count (so what each batch holds) from the first batches' costs:
    # forced, both loaders decide alike whatever the machine's load (a loaded one read 16 and 4)
    with forced_call_costs(call_s=0.01, gil_free=0.0):
        want = [x for x, _ in make()]
        got = _kill_at(make(), at=40)
    # nothing lost or repeated
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_replica_that_cannot_be_replayed_fails_clearly(tmp_path):
    loader = tp.DataLoader(
        Tagged(shorter_after_restart=str(tmp_path / "ran")), batch_size=8, num_workers=1
    )
    with pytest.raises(
        RuntimeError, match="its replacement replayed the replica.*cannot go on without losing data"
    ):
        _kill_at(loader, at=40)


class FailsSecond(IterableDataset):
    def __iter__(self):
        yield 1
        raise OSError("bad record")


@pytest.mark.parametrize("workers", [2, "auto"])
def test_a_replicas_error_names_the_batch_and_the_replica(workers):
    with pytest.raises(OSError, match="bad record") as caught:
        list(tp.DataLoader(FailsSecond(), batch_size=2, num_workers=workers))
    assert (
        "raised in torchpipe stage DataLoader at batch 0, IterableDataset replica 0"
        in caught.value.__notes__
    )


class FewFiles(IterableDataset):
    """Splits 6 "files" between workers as code that reads files by worker does: with more
    workers than files it fails, as ``tp.distributed.share_of_files`` does. Each read waits 2 ms."""

    def __iter__(self):
        info = get_worker_info()
        if info.num_workers > 6:
            raise ValueError(f"6 files for {info.num_workers} workers")
        for f in range(info.id, 6, info.num_workers):
            for i in range(20):
                time.sleep(0.003)
                yield f * 100 + i


def test_a_start_over_whose_replicas_fail_goes_back_to_the_replicas_that_worked():
    ours = tp.DataLoader(FewFiles(), num_workers="auto", batch_size=4, persistent_workers=True)
    expected = sorted(f * 100 + i for f in range(6) for i in range(20))
    assert sorted(int(x) for b in ours for x in b) == expected  # nothing lost, repeated, or raised
    assert ours.stats()[0]["workers"] <= 6
    # and the next epoch keeps that count
    assert sorted(int(x) for b in ours for x in b) == expected

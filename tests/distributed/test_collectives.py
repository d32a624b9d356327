"""Talking to the other ranks: rank 0's seed, a pass's agreement on its own group, bounded waits."""

import datetime
import threading

import pytest
import torch.distributed as dist

from torchpipe.distributed import collectives
from torchpipe.distributed.collectives import DEFAULT_WAIT_S, PassGroup, broadcast_seed


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of this process alone, for the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=(tmp_path / "group").as_uri(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_the_seed_is_rank_0s():
    assert broadcast_seed(2**40 + 7, wait_s=30.0) == 2**40 + 7


@pytest.mark.usefixtures("one_rank")
def test_a_pass_group_agrees_until_it_is_closed_and_opens_once():
    group = PassGroup(wait_s=30.0)
    with pytest.raises(RuntimeError, match="the ranks' agreement is closed"):
        group.all(True)  # not opened yet
    group.open()
    assert group.all(True) and not group.all(False) and group.any(True) and not group.any(False)
    with pytest.raises(RuntimeError, match="opened once"):
        group.open()
    group.close()
    group.close()  # idempotent
    with pytest.raises(RuntimeError, match="the pass was closed"):
        group.any(True)
    with pytest.raises(RuntimeError, match="opened once"):
        group.open()


class _HeldWork:
    """A collective that waits until released."""

    def __init__(self):
        self.waiting, self.release = threading.Event(), threading.Event()

    def wait(self, timeout):
        self.waiting.set()
        assert self.release.wait(30)


@pytest.mark.usefixtures("one_rank")
def test_closing_under_a_waiting_collective_drops_the_group_when_it_ends(monkeypatch):
    group = PassGroup(wait_s=30.0)
    group.open()
    work, destroyed = _HeldWork(), []
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: work)
    monkeypatch.setattr(dist, "destroy_process_group", destroyed.append)
    agreeing = threading.Thread(target=group.all, args=(True,))
    agreeing.start()
    assert work.waiting.wait(30)
    group.close()
    assert destroyed == []  # destroying it now would wait with the collective
    work.release.set()
    agreeing.join(timeout=30)
    assert not agreeing.is_alive() and len(destroyed) == 1


class _FailingWork:
    def __init__(self):
        self.timeouts = []

    def wait(self, timeout):
        self.timeouts.append(timeout)
        raise RuntimeError("Timed out")


@pytest.mark.usefixtures("one_rank")
def test_a_wait_is_bounded_and_its_error_names_the_rank_the_time_and_what_it_waited_for():
    work = _FailingWork()
    with pytest.raises(RuntimeError, match=r"rank 0 waited up to 2.5 s for the seed: Timed out"):
        collectives._wait(work, 2.5, "the seed")
    with pytest.raises(RuntimeError, match=f"waited up to {DEFAULT_WAIT_S:g} s"):
        collectives._wait(work, None, "the seed")
    assert work.timeouts == [
        datetime.timedelta(seconds=2.5),
        datetime.timedelta(seconds=DEFAULT_WAIT_S),
    ]

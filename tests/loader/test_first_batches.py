"""``num_workers="auto"``'s head start: while a long first batch is made and measured here, one
worker process makes the next (loader/first_batches.py), wherever the policy then puts the rest."""

import os
import time

import psutil
import pytest
import torch

import torchpipe as tp
from tests.processes import wait_dead
from torchpipe.loader import first_batches
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.testing import forced_call_costs

pytestmark = pytest.mark.skipif(usable_cpu_count() < 2, reason="no head start on one core")


class FirstWaits(torch.utils.data.Dataset):
    """Item 0, made in the main process, waits (up to 20 s) until batch 1 has been made in
    another process: the first batch runs as long as a worker needs to start. Each item is its
    index, the process that made it and a draw from torch's global RNG."""

    def __init__(self, n, batch, marker, wait=True):
        self.n, self.batch, self.marker, self.wait = n, batch, marker, wait
        self.main = os.getpid()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        here = os.getpid() == self.main
        if i == 0 and here and self.wait:
            deadline = time.monotonic() + 20
            while not os.path.exists(self.marker) and time.monotonic() < deadline:
                time.sleep(0.005)
        if i == 2 * self.batch - 1 and not here:
            open(self.marker, "w").close()
        return torch.tensor([i, os.getpid(), 0.0]) + torch.tensor([0, 0, 1.0]) * torch.rand(1)


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("where", ["inline", "process"])
def test_a_worker_makes_the_second_batch_while_the_first_is_made_here_every_batch_once_in_order(
    tmp_path, where
):
    """Batch 1 is made by a worker process while batch 0 runs here; every batch comes once, in
    sampler order, wherever the decision puts the rest. Placed here, the worker and its zygote
    are gone by the epoch's end; placed on processes, that worker is one of them (not forked
    again)."""
    before = _children()
    dataset = FirstWaits(48, 4, tmp_path / "made")
    loader = tp.DataLoader(dataset, batch_size=4, num_workers="auto")
    cost = {"inline": dict(call_s=1e-5, gil_free=0.0), "process": dict(call_s=0.05, gil_free=0.0)}
    with forced_call_costs(**cost[where], moves=False):
        it = iter(loader)
        batches = list(it)
    rows = torch.cat(batches)
    assert rows[:, 0].long().tolist() == list(range(48))
    pids = [int(b[0, 1]) for b in batches]
    assert pids[0] == os.getpid() and pids[1] != os.getpid()  # the worker's
    assert loader.stats()[0]["executor"] == where
    if where == "process":
        assert pids[1] in pids[2:]  # the head start's worker went on making batches
    else:
        assert set(pids[2:]) == {os.getpid()}
        assert wait_dead(_children() - before) == []  # its worker and zygote let go


def test_batches_with_seeds_are_the_same_with_a_head_start_and_without(tmp_path, monkeypatch):
    """The worker's batch draws what it would have drawn here: each batch's RNGs are seeded from
    the epoch's seed and its index, wherever it is made."""

    def epoch(wait):
        dataset = FirstWaits(24, 4, tmp_path / f"made-{wait}", wait=wait)
        loader = tp.DataLoader(
            dataset,
            batch_size=4,
            shuffle=True,
            num_workers="auto",
            generator=torch.Generator().manual_seed(7),
        )
        with forced_call_costs(call_s=1e-5, gil_free=0.0, moves=False):
            batches = list(iter(loader))
        return torch.cat(batches), {int(b[0, 1]) for b in batches}

    started, makers = epoch(wait=True)
    monkeypatch.setattr(first_batches, "HEAD_START_S", 3600.0)  # never starts
    alone, here = epoch(wait=False)
    assert makers != {os.getpid()} and here == {os.getpid()}
    assert torch.equal(started[:, [0, 2]], alone[:, [0, 2]])


def test_a_cheap_first_batch_starts_no_worker_and_its_zygote_goes_with_the_decision():
    before = _children()
    loader = tp.DataLoader(list(range(64)), batch_size=8, num_workers="auto")
    with forced_call_costs(call_s=1e-5, gil_free=0.0, moves=False):
        it = iter(loader)  # the first batches are measured here: cheap, under 10 ms
        made = _children() - before
        assert torch.cat(list(it)).tolist() == list(range(64))
    assert wait_dead(made) == []


def test_no_head_start_under_a_ram_budget_the_user_gave(tmp_path, monkeypatch):
    monkeypatch.setattr(first_batches, "HEAD_START_S", 0.0)
    before = _children()
    dataset = FirstWaits(16, 4, tmp_path / "made", wait=False)
    options = tp.AutotuneOptions(ram_budget=4 << 30)
    loader = tp.DataLoader(dataset, batch_size=4, num_workers="auto", autotune=options)
    with forced_call_costs(call_s=1e-5, gil_free=0.0, moves=False):
        it = iter(loader)
        assert _children() == before  # nothing forked for it
        pids = {int(b[0, 1]) for b in it}
    assert pids == {os.getpid()}

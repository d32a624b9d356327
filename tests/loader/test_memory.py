"""A DataLoader's RAM budget (``autotune=tp.AutotuneOptions(ram_budget=...)``): what the loader
holds is read from its processes, and a worker is given up while it holds more."""

import os
import random
import time

import psutil
import pytest
import torch

import torchpipe as tp
from torchpipe.loader.memory import CHECK_EVERY_S, MIN_RING_BYTES, LoaderMemory, private_bytes, ring_limit
from torchpipe.runtime.processes.pool import ProcessPool


class Busy(torch.utils.data.Dataset):
    """Items that take CPU and draw from the global RNG (so never on threads): processes pay."""

    def __len__(self):
        return 240

    def __getitem__(self, i):
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        return torch.tensor([i, random.randrange(1000)])


def test_a_process_holds_its_own_pages_and_a_reading_is_taken_a_few_times_a_second():
    assert private_bytes(os.getpid()) > 1 << 20
    assert private_bytes(2**22 + 12345) == 0  # no such process
    memory = LoaderMemory(budget=1.0)
    assert memory.over([os.getpid()], rings_bytes=0)
    assert not memory.over([os.getpid()], rings_bytes=0)  # read again only after CHECK_EVERY_S
    time.sleep(CHECK_EVERY_S)
    assert not LoaderMemory(budget=2**50).over([os.getpid()], rings_bytes=2**20)


def test_rings_get_a_quarter_of_the_budget_shared_by_the_workers():
    assert ring_limit(256 << 20, 4) == 16 << 20
    assert ring_limit(1, 4) == MIN_RING_BYTES


def test_a_worker_within_a_ring_limit_sends_larger_results_in_segments():
    pool = ProcessPool(lambda seq, n: torch.ones(n), 1, "m", ring_bytes=1 << 20, ring_limit=1 << 20, keep_freed=False)
    pool.start()
    try:
        for seq, n in enumerate([10, 1 << 20, 10, 1 << 20]):
            pool.submit(seq, n)
        got = {}
        while len(got) < 4:
            got.update({seq: value for seq, value, _ in pool.collect(0.2)})
        assert [float(got[k].sum()) for k in range(4)] == [10, 1 << 20, 10, 1 << 20]
        assert 0 < pool.ring_bytes <= 1 << 20  # no ring was added for the 4 MB results
    finally:
        pool.close()


def test_over_its_budget_a_loader_gives_up_its_workers_and_loses_no_batch():
    def make(**kwargs):
        return tp.DataLoader(Busy(), batch_size=4, generator=torch.Generator().manual_seed(3), **kwargs)

    ref = make(num_workers="auto", persistent_workers=True)  # per-batch seeds: the same draws anywhere
    want = [[b.tolist() for b in ref] for _ in range(2)]
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # ref's persistent workers among them
    lean = make(num_workers="auto", autotune=tp.AutotuneOptions(ram_budget=1), persistent_workers=True)
    for epoch in range(2):  # the next epoch keeps to the budget
        assert [b.tolist() for b in lean] == want[epoch]  # each batch once, in order, with its draws
        assert lean.stats()[0]["executor"] == "inline"  # no worker process fits in one byte
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left  # nor the workers' zygote, once they are gone


def test_the_autotune_argument_is_checked():
    with pytest.raises(TypeError, match="autotune must be a tp.AutotuneOptions"):
        tp.DataLoader(Busy(), num_workers="auto", autotune={"ram_budget": 1})

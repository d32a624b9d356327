"""``DataLoader.stats()``: the report for torchpipe pipelines and for workers."""

import time

import psutil
import torch

import torchpipe as tp


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.tensor(i)


def test_worker_loader_stats_report_batches_workers_and_waiting():
    loader = tp.DataLoader(Slow(), batch_size=4, num_workers=2)
    assert loader.stats() == []
    it = iter(loader)
    for _ in range(20):
        next(it)
    stats = loader.stats()
    (stage,) = stats
    assert stage["produced"] == 20 and stage["knobs"]["num_workers"] == 2
    assert (stage["executor"], stage["workers"]) == ("process", 2)
    assert set(stage["pids"]) <= {p.pid for p in psutil.Process().children(recursive=True)} and len(stage["pids"]) == 2
    assert 0.008 <= stage["self_s"] < 0.2  # a batch of 4 items of 2 ms on a worker
    assert stats.bottleneck == "DataLoader workers (calls)" and "Limit: the pipeline" in str(stats)
    del it


def test_pipeline_loader_stats_are_the_pipelines():
    ds = tp.range(1000).map(lambda x: torch.tensor(x), num_parallel_calls=tp.AUTOTUNE, executor="thread")
    loader = tp.DataLoader(ds, batch_size=8)
    it = iter(loader)
    for _ in range(10):
        next(it)
    stages = [s["stage"] for s in loader.stats()]
    assert "map(<lambda>)" in stages and "range" in stages


def test_stats_describe_the_last_pass_after_the_loop():
    loader = tp.DataLoader(torch.arange(100.0), batch_size=10, num_workers=2)
    assert "has not started" in loader.stats().report()
    for _ in loader:
        pass
    assert loader.stats()[0]["produced"] == 10  # the iterator is gone; its pass is still reported
    it = iter(loader)
    next(it), next(it)
    del it  # a pass left mid-epoch, as far as it went
    assert loader.stats()[0]["produced"] == 2

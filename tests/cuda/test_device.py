"""The CUDA path of device prefetch: runs only where CUDA exists (skipped elsewhere)."""

import subprocess
import sys

import pytest
import torch

import torchpipe as tp
from torchpipe.ops.device import DevicePrefetcher, PinnedBufferPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def batches(n=20, shape=(64, 3, 32, 32)):
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.rand(shape, generator=g), "y": torch.arange(shape[0]) + i, "name": f"b{i}"}
        for i in range(n)
    ]


def test_values_equal_a_plain_to_device():
    data = batches()
    out = list(DevicePrefetcher(iter(data), "cuda"))
    assert len(out) == len(data)
    for got, want in zip(out, data):
        assert got["x"].is_cuda and got["name"] == want["name"]
        assert torch.equal(got["x"], want["x"].to("cuda")) and torch.equal(
            got["y"], want["y"].to("cuda")
        )


def test_no_use_after_free_under_the_caching_allocator():
    data = batches(40)
    side = torch.cuda.Stream()
    seen = []
    for got, want in zip(DevicePrefetcher(iter(data), "cuda", buffer_size=4), data):
        with torch.cuda.stream(side):  # churn the allocator on another stream meanwhile
            junk = [torch.empty_like(got["x"]).fill_(-1) for _ in range(3)]
        del junk
        seen.append(got["x"].sum().item())
        assert torch.equal(got["x"].cpu(), want["x"])
    assert len(seen) == 40


def test_pinned_buffers_are_reused():
    pool = PinnedBufferPool()
    event = torch.cuda.Event()
    a = pool.stage(torch.ones(1000))
    pool.release_after(event)
    event.record()
    event.synchronize()
    b = pool.stage(torch.zeros(1000))
    assert a.data_ptr() == b.data_ptr() and b.is_pinned()


def test_copy_overlaps_compute():
    data = batches(30, shape=(256, 3, 64, 64))
    weight = torch.randn(1024, 1024, device="cuda")

    def step():
        for _ in range(20):
            weight.matmul(weight)

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in data:
        step()
    end.record()
    torch.cuda.synchronize()
    compute_only = start.elapsed_time(end)
    start.record()
    for batch in DevicePrefetcher(iter(data), "cuda", buffer_size=3):
        step()
    end.record()
    torch.cuda.synchronize()
    with_copies = start.elapsed_time(end)
    assert with_copies < compute_only * 1.5  # the copies hide behind the matmuls


def test_loader_and_pipeline_deliver_on_cuda():
    data = torch.utils.data.TensorDataset(torch.arange(100.0))
    got = list(tp.DataLoader(data, batch_size=10, num_workers=2, device="cuda"))
    expected = list(torch.utils.data.DataLoader(data, batch_size=10))
    assert len(got) == len(expected) == 10
    for batch, want in zip(got, expected):
        assert batch[0].is_cuda and torch.equal(batch[0].cpu(), want[0])
    out = list(tp.range(5).map(lambda x: torch.full((3,), x)).to_device("cuda"))
    assert all(t.is_cuda for t in out) and [int(t[0]) for t in out] == list(range(5))


def test_loader_resume_counts_batches_handed_over_not_copied_ahead():
    data = torch.utils.data.TensorDataset(torch.arange(64.0))

    def make():
        return tp.DataLoader(
            data,
            batch_size=4,
            shuffle=True,
            num_workers=2,
            device="cuda",
            generator=torch.Generator().manual_seed(3),
        )

    loader = make()
    it = iter(loader)
    head = [next(it)[0].cpu() for _ in range(5)]
    state = loader.state_dict()
    assert state["yielded"] == 5
    rest = [b[0].cpu() for b in it]
    fresh = make()
    fresh.load_state_dict(state)
    again = [b[0].cpu() for b in fresh]
    assert len(head) + len(rest) == 16 and len(again) == len(rest) == 11
    assert all(torch.equal(a, b) for a, b in zip(again, rest))


_LEAVE_OPEN = """
import torch, torchpipe as tp
data = torch.utils.data.TensorDataset(torch.rand(4096, 3, 64, 64))
it = iter(tp.DataLoader(data, batch_size=64, num_workers=2, device="cuda"))
next(it)
pipe = iter(tp.range(1000).map(lambda i: torch.rand(64, 3, 64, 64)).to_device("cuda"))
next(pipe)
dropped = iter(tp.DataLoader(data, batch_size=64, num_workers=2, device="cuda"))
next(dropped)
del dropped  # its copy thread finishes the batch in hand after this
print("left open")
"""


def test_exit_with_an_epoch_left_open_is_clean():
    # a loop left with `break` (or an epoch dropped) leaves copy threads running: the interpreter's exit must stop
    # them before CUDA is torn down ("terminate called without an active exception")
    done = subprocess.run(
        [sys.executable, "-c", _LEAVE_OPEN], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0 and "left open" in done.stdout, done.stderr
    assert "terminate" not in done.stderr

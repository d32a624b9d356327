"""GPU overlap: does the host-to-device copy hide behind the training step?

A GPU step of fixed length (a matmul chain, calibrated to --step-ms on data already there) is fed
by (a) a batch already on the GPU, (b) torch's DataLoader with pin_memory=True and
.to(device, non_blocking=True), (c) torchpipe.DataLoader(device="cuda"). Each reports its time
per step and the ratio to (a). In (b) the copy is queued on the step's own stream, so the GPU
copies, then computes; (c) copies on a side stream while the previous step computes. Target: (c)
within 3% of (a).

The overlap is only judged where the loader alone keeps up with the step: the bench also times
each loader with no step at all (its ms/batch) and the copy of one pinned batch, and says so
when the data, not the copy, sets the pace.

Run: python bench/gpu_overlap.py [--steps 100] [--batch 128] [--workers 6] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp

_WIDTH = 4096


class Images(torch.utils.data.Dataset):
    """Synthetic float32 3x224x224 images, made cheaply."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.image = torch.rand(3, 224, 224)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.image + i % 7, i % 10


def make_step(weight: torch.Tensor, repeats: int):
    def step(x: torch.Tensor) -> None:
        h = x.flatten(1)[:, :_WIDTH]
        for _ in range(repeats):
            h = torch.tanh(h @ weight)

    return step


def calibrate(weight: torch.Tensor, x: torch.Tensor, step_ms: float) -> int:
    """The matmul repeats that make one step take about ``step_ms`` on ``x``."""
    probe = 8
    seconds = timed(iter(lambda: (x, None), None), make_step(weight, probe), 20, to_device=False)
    return max(1, round(probe * step_ms / (seconds * 1e3)))


def timed(batches, step, steps: int, to_device: bool) -> float:
    """Seconds per step over ``steps`` steps, after five to warm up (workers started, caches filled)."""
    it = iter(batches)
    for _ in range(5):
        x, _ = next(it)
        step(x.to("cuda", non_blocking=True) if to_device else x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        x, _ = next(it)
        step(x.to("cuda", non_blocking=True) if to_device else x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    del it  # the epoch's workers and copy thread stop here, not at interpreter exit
    gc.collect()
    return seconds


def copy_ms(batch: int) -> float:
    """Milliseconds to copy one pinned batch to the GPU."""
    host = torch.rand(batch, 3, 224, 224).pin_memory()
    host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 10 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument(
        "--step-ms", type=float, default=20.0, help="the step's length on resident data"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench/gpu_overlap.py needs a CUDA GPU; none is available here (nothing measured)."
        )
    weight = torch.randn(_WIDTH, _WIDTH, device="cuda") / 64
    on_gpu = torch.rand(args.batch, 3, 224, 224, device="cuda")
    step = make_step(weight, calibrate(weight, on_gpu, args.step_ms))
    idle = make_step(weight, 0)
    count = 2 * (args.steps + 10) * args.batch
    loader = dict(batch_size=args.batch, num_workers=args.workers)

    def torch_loader():
        return torch.utils.data.DataLoader(Images(count), pin_memory=True, **loader)

    def torchpipe_loader():
        return tp.DataLoader(Images(count), device="cuda", **loader)

    resident = timed(iter(lambda: (on_gpu, None), None), step, args.steps, to_device=False)
    rows = [("(a) data already on the GPU", resident, None)]
    for name, make, to_device in [
        ("(b) torch DataLoader, pin_memory", torch_loader, True),
        ("(c) torchpipe DataLoader, device='cuda'", torchpipe_loader, False),
    ]:
        fed = timed(make(), step, args.steps, to_device)
        alone = timed(make(), idle, args.steps, to_device)
        rows.append((name, fed, alone))
    print(
        f"batch {args.batch}x3x224x224 float32 ({args.batch * 3 * 224 * 224 * 4 / 1e6:.0f} MB), "
        f"{args.workers} workers; copy of one pinned batch {copy_ms(args.batch):.2f} ms"
    )
    print(f"{'feed':<40} {'ms/step':>8} {'vs on-GPU':>10} {'loader alone ms/batch':>22}")
    for name, t, alone in rows:
        alone_text = "" if alone is None else f"{alone * 1e3:>22.2f}"
        print(f"{name:<40} {t * 1e3:>8.2f} {t / resident:>9.3f}x {alone_text}")
    for name, _, alone in rows[1:]:
        if alone > 0.97 * resident:
            print(
                f"note: {name[4:]} alone takes {alone / resident:.2f}x the step: the data, not the copy, "
                "sets its pace (raise --workers or --step-ms to judge the overlap)"
            )


if __name__ == "__main__":
    main()

"""Data-parallel training with one pipeline: each rank reads its own share, and all take as many steps.

Run on CPU with two processes:

    torchrun --nproc_per_node=2 examples/ddp.py

or as one process (``python examples/ddp.py``). The pipeline is the one you would write for a
single process: under torchrun it is split between the ranks by itself (docs/distributed.md).
The script checks, with the ranks' own numbers, that every element of an epoch reached exactly
one rank and that the ranks took the same number of steps (a rank with one step more would hang
DDP's gradient all-reduce), then does the same with ``tp.DataLoader`` and ``DistributedSampler``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import torchpipe as tp


class Points(torch.utils.data.Dataset):
    """A map-style dataset of ``(index, features, target)`` rows of a linear problem."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x @ torch.arange(1.0, 9.0) + 0.1 * torch.randn(n, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def jitter(i: int, x: torch.Tensor, y: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    noise = torch.from_numpy(tp.rng().normal(scale=0.01, size=8)).float()  # per element, per rank
    return i, x + noise, y


def train(
    batches, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, list[int]]:
    steps, seen = 0, []
    for i, x, y in batches:
        optimizer.zero_grad()
        # DDP all-reduces the gradients
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        optimizer.step()
        steps += 1
        seen += i.tolist()
    return steps, seen


def check(name: str, epoch: int, steps: int, seen: list[int], n: int) -> None:
    """Every element at most once over the ranks, and the same number of steps on each."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    all_steps, all_seen = [None] * world, [None] * world
    if dist.is_initialized():
        dist.all_gather_object(all_steps, steps)
        dist.all_gather_object(all_seen, seen)
    else:
        all_steps, all_seen = [steps], [seen]
    union = [i for share in all_seen for i in share]
    assert len(set(all_steps)) == 1, f"ranks took different numbers of steps: {all_steps}"
    assert len(union) == len(set(union)), "an element reached two ranks"
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"{name} epoch {epoch}: {world} ranks x {steps} steps, {len(union)} of {n} elements, none twice",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = torch.nn.Linear(8, 1)
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    # The single-process pipeline, unchanged: no seed, no rank, no sampler.
    pipeline = (
        tp.from_dataset(Points(args.elements))
        .shuffle(args.elements)
        .map(jitter, num_parallel_calls=2)
        .batch(32)
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(pipeline.explain().split("As it will run:")[0])
    for epoch in range(args.epochs):
        steps, seen = train(pipeline, model, optimizer)
        check("pipeline", epoch, steps, seen, args.elements)

    # torch's way, through tp.DataLoader: the DistributedSampler does the splitting, as in torch.
    points = Points(args.elements)
    sampler = (
        torch.utils.data.distributed.DistributedSampler(points, drop_last=True)
        if dist.is_initialized()
        else None
    )
    loader = tp.DataLoader(
        points, batch_size=32, sampler=sampler, shuffle=sampler is None, num_workers=2
    )
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        steps, seen = train(loader, model, optimizer)
        check(
            "tp.DataLoader" + (" + DistributedSampler" if sampler is not None else ""),
            epoch,
            steps,
            seen,
            args.elements,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What torchpipe.DataLoader(num_workers="auto") gains over torch's DataLoader, on a training run
whose input pipeline is the bottleneck.

A small CNN trains on synthetic JPEGs with the benchmark's ``jpeg`` work per image (Pillow decode
of a ~320 px JPEG, random 224 crop, random flip). The model is kept tiny on purpose (it looks at
a 28 px thumbnail of each crop), as when a GPU trains a small model: the loader, not the step,
sets the pace. The same loop is fed in turn by what a user would write:

- ``torch.utils.data.DataLoader(...)`` with its default ``num_workers=0``;
- the same with ``num_workers`` = the usable cores, a hand-picked count;
- ``torchpipe.DataLoader(..., num_workers="auto")``: no count to pick.

While each runs a progress bar (tqdm's, on a terminal; silent in a log) shows the steps done, images
per second so far and the share of time the loop waited for data. At the end
it prints, for each, images per second, that waiting share, the time to the first batch, how
busy the cores were (and how much other processes took) and the CPU time per image; then
torchpipe's speed-up over each torch loader and, where it is not faster, why, from what was
measured. The JPEGs are generated on first use into ``$TORCHPIPE_BENCH_CACHE`` (default
``~/.cache/torchpipe-bench``). About a minute on 2 cores.

Run: python examples/train_synthetic.py [--steps 400] [--batch-size 32] [--files 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchpipe as tp
from bench import data
from bench.measure import busy_cpu_seconds, usable_cpus
from bench.workloads import JpegSample, Mapped

WARMUP_STEPS = 5
THUMBNAIL_STRIDE = 8  # 224 px crops -> 28 px thumbnails
WAITING_LIMIT = 0.2  # a loop that waits less than this share of its time is limited by its step
# other processes' share of the cores above which the comparison is not the loaders'
OTHERS_LIMIT = 0.15
SAME = 0.05  # speed-ups within 5% of 1 are "about the same" (run-to-run noise on a shared machine)


def small_cnn(classes: int = 10) -> torch.nn.Module:
    """Two strided convolutions on a 28 px thumbnail: a step far cheaper than decoding the batch."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, classes),
    )


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live descendants (the loader's workers)."""
    total = 0.0
    for process in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue  # exited between the listing and the read
    return total


class Progress:
    """A progress bar that follows a run: tqdm's on a terminal (``pip install 'torchpipe[progress]'``;
    a line redrawn in place without it), silent when the output is not a terminal (a log, CI)."""

    def __init__(self, name: str, total: int, stream: TextIO = sys.stdout) -> None:
        self.name, self.total, self.stream = name, total, stream
        self.tty = stream.isatty()
        self.last = time.perf_counter()
        self.bar = None
        if self.tty:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(
                    desc=f"  {name}",
                    total=total,
                    unit="step",
                    file=stream,
                    leave=False,
                    dynamic_ncols=True,
                )

    def update(self, step: int, images: int, seconds: float, waited: float) -> None:
        now = time.perf_counter()
        if not self.tty or now - self.last < 0.25 or seconds <= 0:
            return
        self.last = now
        rates = f"{images / seconds:>6.0f} img/s  waiting for data {waited / seconds:>4.0%}"
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(rates, refresh=False)
            return
        self.stream.write(
            f"\r  {self.name:<40} step {step:>4}/{self.total}  {rates}\x1b[K"
        )  # \x1b[K: clear the rest
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


@dataclass
class Result:
    """What one run measured (rates over the steps after the warm-up)."""

    images_per_s: float
    wait_fraction: float
    first_batch_s: float
    cpu_busy: float  # CPU seconds of this process tree / (wall seconds x usable cores)
    cpu_per_image_s: float  # CPU seconds of this process tree per image
    others_busy: float  # the same share, of every other process on those cores
    stats: Any = None  # torchpipe's loader.stats() at the end of the run, if it has one


def step_fn(
    model: torch.nn.Module, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step on a uint8 image batch: thumbnail, forward, backward, update."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        thumbnail = x[:, :, ::THUMBNAIL_STRIDE, ::THUMBNAIL_STRIDE].float().div_(255)
        loss = torch.nn.functional.cross_entropy(model(thumbnail), y % 10)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def train(loader: Any, steps: int, device: torch.device, progress: Progress) -> Result:
    """``WARMUP_STEPS`` steps (worker start-up, first batches), then ``steps`` timed ones."""
    torch.manual_seed(0)
    step = step_fn(small_cnn().to(device), device)
    t0 = time.perf_counter()
    iterator = iter(loader)
    x, y = next(iterator)
    first = time.perf_counter() - t0
    for _ in range(WARMUP_STEPS):
        step(x, y)
        x, y = next(iterator)
    cpus = usable_cpus()
    cpu0, all0, start = tree_cpu_seconds(), busy_cpu_seconds(cpus), time.perf_counter()
    waited, images = 0.0, 0
    for done in range(1, steps + 1):
        step(x, y)
        images += x.shape[0]
        before = time.perf_counter()
        x, y = next(iterator)
        waited += time.perf_counter() - before
        progress.update(done, images, time.perf_counter() - start, waited)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    capacity = total * len(cpus)
    ours, everyone = tree_cpu_seconds() - cpu0, busy_cpu_seconds(cpus) - all0
    stats = (
        loader.stats() if isinstance(loader, tp.DataLoader) else None
    )  # while its iterator lives
    del iterator  # stops the workers
    progress.close()
    others = min(1.0, max(0.0, everyone - ours) / capacity)  # /proc/stat counts in 10 ms ticks
    return Result(
        images / total, waited / total, first, ours / capacity, ours / images, others, stats
    )


def describe(name: str, result: Result) -> str:
    """One run's result line."""
    return (
        f"  {name:<40} {result.images_per_s:>6.0f} img/s   waiting for data {result.wait_fraction:>4.0%}   "
        f"first batch {result.first_batch_s:.2f} s   cores busy {result.cpu_busy:>4.0%} (others "
        f"{result.others_busy:.0%})   CPU {result.cpu_per_image_s * 1e3:.2f} ms/img"
    )


def why_not_faster(ours: Result, theirs: Result, cores: int) -> str:
    """The reason, from what both runs measured, that torchpipe was not faster than a torch loader."""
    if ours.wait_fraction < WAITING_LIMIT:
        return (
            f"the training step, not data, was the limit: the loop waited for data only "
            f"{ours.wait_fraction:.0%} of its time, so a faster loader cannot make it faster"
        )
    if min(ours.cpu_busy, theirs.cpu_busy) >= 0.85:
        more = ours.cpu_per_image_s / theirs.cpu_per_image_s - 1
        cost = (
            f"torchpipe spent {more:.0%} more CPU per image ({ours.cpu_per_image_s * 1e3:.2f} ms against "
            f"{theirs.cpu_per_image_s * 1e3:.2f} ms)"
            if more > SAME
            else "both spent the same CPU per image"
        )
        return (
            f"both kept the {cores} cores busy ({theirs.cpu_busy:.0%} and {ours.cpu_busy:.0%}), so the "
            f"cores set the pace, and {cost}"
        )
    stats = ours.stats
    named = (
        f"torchpipe's stats name {stats.bottleneck!r} as the bottleneck" if stats else "no stats"
    )
    return (
        f"data was the limit (the loop waited {ours.wait_fraction:.0%} of its time) with the cores "
        f"{ours.cpu_busy:.0%} busy; {named} (print(loader.stats()) shows where the time goes)"
    )


def compare(ours: Result, theirs: Result, their_name: str, cores: int) -> str:
    """torchpipe's speed-up over one torch loader; why where it is not faster; whether it was fair."""
    speedup = ours.images_per_s / theirs.images_per_s
    line = f"  {speedup:.2f}x the images/s of {their_name}"
    others = max(ours.others_busy, theirs.others_busy)
    shared = (
        f"other processes took up to {others:.0%} of the cores during these two runs: the loaders did "
        f"not have the machine to themselves; run it again on an idle one"
    )
    if speedup >= 1 + SAME:
        return line + (f" ({shared})" if others >= OTHERS_LIMIT else "")
    verdict = "about the same" if speedup > 1 - SAME else "slower"
    reason = shared if others >= OTHERS_LIMIT else why_not_faster(ours, theirs, cores)
    return f"{line}: {verdict}, because {reason}"


def settled(stats: Any) -> str:
    """The knobs torchpipe's loader ran with at the end (its root stage's), e.g. num_workers=2."""
    knobs = stats[0].get("knobs", {}) if stats else {}
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) or "its defaults"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="timed training steps per loader")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--files", type=int, default=1024, help="synthetic JPEGs to generate and train on"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        # The step's own threads would fight the loaders' workers for the cores (on 2 cores, two
        # intra-op threads beside busy workers made the step several times slower).
        torch.set_num_threads(1)
    cores = len(usable_cpus())
    # One epoch covers the whole run (files are reused): no epoch restarts inside the timing.
    length = (args.steps + WARMUP_STEPS + 1) * args.batch_size
    print(
        f"{args.files} synthetic JPEGs in {data.cache_dir()} (made on first use, ~10 s)", flush=True
    )
    dataset = Mapped(JpegSample(data.jpeg_files(args.files)), length)
    common = dict(batch_size=args.batch_size, shuffle=True, drop_last=True)
    # torch's DataLoader has no device=: pinned memory is how it speeds up the copy to a GPU.
    runs = {
        "torch DataLoader, num_workers=0": lambda: torch.utils.data.DataLoader(
            dataset, pin_memory=cuda, **common
        ),
        f"torch DataLoader, num_workers={cores}": lambda: torch.utils.data.DataLoader(
            dataset, num_workers=cores, pin_memory=cuda, **common
        ),
        'torchpipe.DataLoader, num_workers="auto"': lambda: tp.DataLoader(
            dataset, num_workers="auto", device="cuda" if cuda else None, **common
        ),
    }
    print(
        f"{args.steps} steps of batch {args.batch_size} on {device}, {cores} usable cores, per loader:",
        flush=True,
    )
    results = {}
    for name, make in runs.items():
        results[name] = train(make(), args.steps, device, Progress(name, args.steps))
        print(describe(name, results[name]), flush=True)
    *torch_names, ours_name = results
    ours = results[ours_name]
    print(f'torchpipe.DataLoader(num_workers="auto") ran with {settled(ours.stats)} at the end:')
    for name in torch_names:
        print(compare(ours, results[name], name, cores))


if __name__ == "__main__":
    main()

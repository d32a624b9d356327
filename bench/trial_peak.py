"""What an auto stage holds at its peak while its calls move between executors (issue #58).

The executor policy tries executors while a pass runs (processes, then threads or inline, then
back), and the zero-knob rows' peak memory came from those trials: the executor being left still
held its memory while the trial's filled. This probe plays one fixed sequence of moves (the
tests' :func:`~torchpipe.testing.move_calls`, with the policy's own verdicts held and autotune
off, so every run makes the same moves), the loader ahead of a training step of ``--step``
seconds, and samples the process tree's held memory (:class:`bench.measure.TreeMonitor`) every
50 ms from before the loader is made. Printed: the peak over the run and each phase's peak and
last reading (MB over the tree before the loader), and batches a second per phase; ``torch_N``
runs torch's DataLoader with N workers for the whole run, the reference. A phase
``kind:count:kept`` plays, a third of the way in, the window whose verdict keeps the calls
there (:func:`~torchpipe.testing.keep_calls`: the pool the calls left lets its workers and
zygote go), so that the phase's last reading is the end state of a run that settled there.

    python -m bench.trial_peak bigtensor dsl --repeat 3
    python -m bench.trial_peak bigtensor dl torch_2 --phases process:2,thread:2,inline:0
    python -m bench.trial_peak tfrecord dsl torch_0 --phases process:2,thread:2:kept
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

PHASES = "process:2,thread:2,process:2,inline:0,process:2"
PHASE_S = 1.5


def _dataset(workload: str) -> Any:
    from bench import data, workloads

    if workload == "jpeg":
        return workloads.JpegSample(data.jpeg_files(1024))
    if workload == "bigtensor":
        return workloads.big_tensor
    if workload == "tfrecord":  # the DataLoader's item of bench/run.py's tfrecord rows
        from bench import tfrecord

        paths = tfrecord.tfrecord_shards(1024)
        return tfrecord.RecordSample(tp_records(paths))
    raise ValueError(f"workload: 'jpeg', 'bigtensor' or 'tfrecord', not {workload!r}")


def tp_records(paths: list[str]) -> Any:
    """The shards' records by index (``tp.io.TFRecordRecords``)."""
    import torchpipe as tp

    return tp.io.TFRecordRecords(paths)


def _phases(text: str) -> list[tuple[str, int, bool]]:
    """``kind:count`` or ``kind:count:kept`` each (``kept``: a third of the way into the phase a
    window's verdict keeps the calls there, :func:`~torchpipe.testing.keep_calls`)."""
    phases = []
    for part in text.split(","):
        kind, count, *rest = part.split(":") + [""]
        kept = rest[0] == "kept"
        if (
            kind not in ("inline", "thread", "process")
            or not count.isdigit()
            or rest[0] not in ("", "kept")
            or len(rest) > 2
        ):
            raise ValueError(
                f"a phase is kind:count or kind:count:kept (inline, thread or process), not {part!r}"
            )
        phases.append((kind, int(count), kept))
    return phases


def _start(config: str, fn: Any, gil_free: float = 0.5) -> Any:
    """The iterator of ``config`` over ``fn``'s elements, its first batch taken."""
    import torchpipe as tp
    from bench import workloads
    from torchpipe.testing import forced_call_costs

    if config.startswith("torch_"):
        loader = torch.utils.data.DataLoader(
            workloads.Mapped(fn, 10**7), batch_size=64, num_workers=int(config[6:])
        )
        return iter(loader)
    off = tp.AutotuneOptions(enabled=False)  # the knobs stay: every run makes the same moves
    with forced_call_costs(5e-3, gil_free=gil_free, moves=False):
        if config == "dl":
            dl = tp.DataLoader(
                workloads.Mapped(fn, 10**7), batch_size=64, num_workers="auto", autotune=off
            )
            return iter(dl)
        if config != "dsl":
            raise ValueError(f"config: dsl, dl or torch_N, not {config!r}")
        ds = tp.from_dataset(range(10**7)).map(fn, tp.AUTOTUNE, executor="auto").batch(64)
        it = iter(ds.prefetch(tp.AUTOTUNE).with_options(tp.Options(autotune=off)))
        next(it)  # a map measures its first calls at its first element
        return it


def _parts(shmem_at_start: int) -> dict[str, Any]:
    """What this process and each child hold alone now (PSS without shared memory, MB), and the
    machine's shared memory gained since the start (the rings, the segments)."""
    import os

    import psutil

    from bench.measure import system_shmem

    def own(pid: int) -> float:
        fields = {}
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    key, value, *_ = line.split()
                    if value.isdigit():
                        fields[key] = int(value) * 1024
        except OSError:
            return 0.0
        return round((fields.get(b"Pss:", 0) - fields.get(b"Pss_Shmem:", 0)) / 2**20)

    children = psutil.Process().children(recursive=True)
    return {
        "main": own(os.getpid()),
        "children": [own(c.pid) for c in children],
        "shmem": round(((system_shmem() or 0) - shmem_at_start) / 2**20),
    }


def trial(
    workload: str,
    config: str,
    phases: list[tuple[str, int, bool]],
    step: float,
    gil_free: float = 0.5,
) -> dict:
    """One run in this process: the peak, and each phase's peak, last reading and batches/s."""
    from bench.measure import release_memory, system_shmem
    from torchpipe.testing import keep_calls, move_calls

    fn = _dataset(workload)
    release_memory()
    shmem_at_start = system_shmem() or 0
    # (time, MB held over the tree before the loader, what each process held then)
    readings: list[tuple[float, float, dict[str, Any]]] = []
    start_parts = _parts(shmem_at_start)
    before = start_parts["main"] + sum(start_parts["children"])
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            parts = _parts(shmem_at_start)
            held = parts["main"] + sum(parts["children"]) + parts["shmem"] - before
            readings.append((time.perf_counter(), held, parts))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    it = _start(config, fn, gil_free)
    bounds, rates, parts = [], [], []
    for kind, count, kept in phases:
        if not config.startswith("torch_"):
            move_calls(it, kind, count)
        start, batches, keep = time.perf_counter(), 0, kept and not config.startswith("torch_")
        while time.perf_counter() - start < PHASE_S:
            batch = next(it)  # noqa: F841 - held while the next comes, as in a training loop
            batches += 1
            time.sleep(step)
            if keep and time.perf_counter() - start >= PHASE_S / 3:
                keep_calls(it)
                keep = False
        bounds.append((start, time.perf_counter()))
        rates.append(batches / (time.perf_counter() - start))
    stop.set()
    sampler.join()
    del it
    phase_peaks, phase_last = [], []
    for begin, end in bounds:
        inside = [r for r in readings if begin <= r[0] <= end] or [(0.0, 0.0, {})]
        top = max(inside, key=lambda r: r[1])
        phase_peaks.append(round(top[1]))
        phase_last.append(round(inside[-1][1]))
        parts.append(top[2])
    return {
        "peak_mb": round(max(r[1] for r in readings)),
        "phase_peak_mb": phase_peaks,
        "phase_last_mb": phase_last,
        "batches_per_s": [round(r, 1) for r in rates],
        "phase_peak_parts": parts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=["jpeg", "bigtensor", "tfrecord"])
    parser.add_argument("configs", nargs="+", help="dsl, dl or torch_N")
    parser.add_argument("--phases", default=PHASES, help="kind:count,... (default %(default)s)")
    parser.add_argument("--step", type=float, default=0.01, help="the training step's seconds")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--gil-free",
        type=float,
        default=0.5,
        help="the calls' forced GIL-free share (1: the policy's verdict on threads is threads, "
        "so a window there keeps them and the parked pool is let go)",
    )
    parser.add_argument("--trial", action="store_true", help="one run in this process")
    args = parser.parse_args()
    phases = _phases(args.phases)
    if args.trial:
        print(json.dumps(trial(args.workload, args.configs[0], phases, args.step, args.gil_free)))
        return
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.repeat):  # alternating, each run in a fresh process
        for config in args.configs:
            command = [sys.executable, "-m", "bench.trial_peak", args.workload, config, "--trial"]
            command += ["--phases", args.phases, "--step", str(args.step)]
            command += ["--gil-free", str(args.gil_free)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
            runs[config].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for config, found in runs.items():
        median = {
            "peak_mb": statistics.median(r["peak_mb"] for r in found),
            "phase_peak_mb": [
                statistics.median(p) for p in zip(*(r["phase_peak_mb"] for r in found))
            ],
            "batches_per_s": [
                statistics.median(p) for p in zip(*(r["batches_per_s"] for r in found))
            ],
            "runs_peak_mb": [r["peak_mb"] for r in found],
        }
        print(json.dumps({"workload": args.workload, "config": config, **median}), flush=True)


if __name__ == "__main__":
    main()

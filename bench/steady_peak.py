"""The zero-knob DSL row at its steady state beside torch's DataLoader: peak held memory and
batches a second (issue #58).

Where ``bench/trial_peak.py`` plays fixed placement moves with autotune off, this probe runs
``bench/run.py``'s ``torchpipe_auto`` row as a user would (``map(fn, tp.AUTOTUNE,
executor="auto").batch(64).prefetch(tp.AUTOTUNE)``, autotune and the placement policy on) and
torch's ``DataLoader(num_workers=2, prefetch_factor=2)``, each in a fresh process, ahead of a
training step of ``--step`` seconds (0: none). The tree's held memory (each process's PSS
without shared memory, plus the shared memory the machine gained) is sampled every 50 ms from
before the loader is made; printed: its peak (MB over the tree before the loader), what each
process held at that peak, the peak over the run's second half (``late_peak_mb``: once the
placement trials are mostly over) and the last reading (``end_mb``, ``end_parts``), batches a
second over the run's second half, and where the map ran. On ``tfrecord`` also ``thread_N``
and ``inline``: the same map fixed there.

    python -m bench.steady_peak bigtensor dsl torch_2 --step 0.01 --repeat 3
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

from bench.trial_peak import _dataset, _parts


def _tfrecord(config: str) -> Any:
    """``tfrecord``'s rows: the DSL (``bench/run.py``'s ``torchpipe_auto``) or the DataLoader's item."""
    from pathlib import Path

    import torchpipe as tp
    from bench import tfrecord, workloads

    paths = tfrecord.tfrecord_shards(JPEG_FILES)
    pattern = str(Path(paths[0]).parent / "train-*.tfrecord")
    if config == "dsl":
        ds = tfrecord.pipeline_builder(pattern)(tp.AUTOTUNE, "auto").batch(64)
        return ds.prefetch(tp.AUTOTUNE)
    if config.startswith("thread_"):  # the same map fixed on N threads (what "auto" may end on)
        ds = tfrecord.pipeline_builder(pattern)(int(config[7:]), "thread").batch(64)
        return ds.prefetch(tp.AUTOTUNE)
    if config == "inline":  # the same map on the consumer's thread
        return tfrecord.pipeline_builder(pattern)(None, "thread").batch(64).prefetch(tp.AUTOTUNE)
    return workloads.Mapped(tfrecord.RecordSample(tp.io.TFRecordRecords(paths)), 10**7)


JPEG_FILES = 1024
"""The ``jpeg`` and ``tfrecord`` workloads' files (``bench/run.py --quick``'s)."""


def _loader(workload: str, config: str) -> Any:
    import torch

    import torchpipe as tp
    from bench import workloads

    if workload == "tfrecord":
        made = _tfrecord(config)
        if config == "dsl" or config.startswith("thread_") or config == "inline":
            return iter(made)
        if config == "dl":
            return iter(tp.DataLoader(made, batch_size=64, num_workers="auto"))
        workers = int(config[6:])
        loader = torch.utils.data.DataLoader(
            made, batch_size=64, num_workers=workers, prefetch_factor=2 if workers else None
        )
        return iter(loader)
    fn = _dataset(workload)
    if config.startswith("torch_"):
        data = workloads.Mapped(fn, 10**7)
        workers = int(config[6:])
        return iter(
            torch.utils.data.DataLoader(
                data, batch_size=64, num_workers=workers, prefetch_factor=2 if workers else None
            )
        )
    if config == "dl":
        data = workloads.Mapped(fn, 10**7)
        return iter(tp.DataLoader(data, batch_size=64, num_workers="auto"))
    if config != "dsl":
        raise ValueError(f"config: dsl, dl or torch_N, not {config!r}")
    ds = tp.from_dataset(range(10**7)).map(fn, tp.AUTOTUNE, executor="auto").batch(64)
    return iter(ds.prefetch(tp.AUTOTUNE))


def trial(workload: str, config: str, seconds: float, step: float) -> dict[str, Any]:
    """One run in this process."""
    from bench.measure import release_memory, system_shmem

    release_memory()
    shmem_at_start = system_shmem() or 0
    start_parts = _parts(shmem_at_start)
    before = start_parts["main"] + sum(start_parts["children"])
    # (MB held over the tree before the loader, what each process held then, when)
    readings: list[tuple[float, dict[str, Any], float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            parts = _parts(shmem_at_start)
            held = parts["main"] + sum(parts["children"]) + parts["shmem"] - before
            readings.append((held, parts, time.perf_counter()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    it = _loader(workload, config)
    start = time.perf_counter()
    half, count, count_half = start + seconds / 2, 0, 0
    while (now := time.perf_counter()) - start < seconds:
        batch = next(it)  # noqa: F841 - held while the next comes, as in a training loop
        count += 1
        if now < half:
            count_half = count
        if step:
            time.sleep(step)
    rate = (count - count_half) / (time.perf_counter() - half)
    stop.set()
    sampler.join()
    where = ""
    if hasattr(it, "stats"):
        where = " ".join(
            f"{s['stage']}:{s.get('executor')}x{s.get('workers')}{s.get('knobs', '')}"
            for s in it.stats()
            if "executor" in s
        )
    del it
    top = max(readings, key=lambda r: r[0])
    late = [r for r in readings if r[2] >= half] or readings
    return {
        "peak_mb": round(top[0]),
        "parts": top[1],
        "late_peak_mb": round(max(r[0] for r in late)),
        "end_mb": round(late[-1][0]),
        "end_parts": late[-1][1],
        "batches_per_s": round(rate, 1),
        "where": where,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=["jpeg", "bigtensor", "tfrecord"])
    parser.add_argument(
        "configs", nargs="+", help="dsl, dl or torch_N (tfrecord: also thread_N, inline)"
    )
    parser.add_argument("--step", type=float, default=0.01, help="the training step's seconds")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--trial", action="store_true", help="one run in this process")
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(trial(args.workload, args.configs[0], args.seconds, args.step)))
        return
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.repeat):  # alternating, each run in a fresh process
        for config in args.configs:
            command = [sys.executable, "-m", "bench.steady_peak", args.workload, config, "--trial"]
            command += ["--step", str(args.step), "--seconds", str(args.seconds)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
            found = json.loads(done.stdout.strip().splitlines()[-1])
            runs[config].append(found)
            print(json.dumps({"config": config, **found}), flush=True)
    for config, found in runs.items():
        print(
            json.dumps(
                {
                    "workload": args.workload,
                    "step": args.step,
                    "config": config,
                    "peak_mb": statistics.median(r["peak_mb"] for r in found),
                    "late_peak_mb": statistics.median(r["late_peak_mb"] for r in found),
                    "end_mb": statistics.median(r["end_mb"] for r in found),
                    "batches_per_s": statistics.median(r["batches_per_s"] for r in found),
                    "runs_peak_mb": [r["peak_mb"] for r in found],
                    "runs_batches_per_s": [r["batches_per_s"] for r in found],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

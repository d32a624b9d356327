"""How close ``tp.DataLoader("auto")``'s peak stays to a RAM budget that binds (issue #58).

For each workload (``jpeg``: decode, crop, flip, batch 64; ``bigtensor``: 38 MB float batches;
``tfrecord``: the same JPEGs parsed from TFRecord shards), each configuration runs in a fresh
process, the loader ahead of a 10 ms training step (``--step-ms 0``: none, as the bench's rows
measure), and the process tree's held memory (:class:`bench.measure.TreeMonitor`: PSS without
shared memory, plus the machine's shared memory gained; ``--own-shm``: plus only the shared
memory the tree's processes map or hold open, which other jobs on a shared machine do not move)
is sampled every 50 ms from before the loader is made. The
budget is set as ``bench/run.py``'s budget rows set it: halfway between torch's peak without
workers and ``tp.DataLoader("auto")``'s unconstrained peak (medians); the loader's ``ram_budget``
is that less torch's peak without workers. Printed: the median of ``--repeat`` runs of each, the
budgeted loader's peak against the budget, and its speed against the fastest torch DataLoader
whose peak fits.

    python -m bench.budget_peak --repeat 3

One configuration alone: ``python -m bench.budget_peak --trial jpeg tp_2 0`` (``torch_N`` and
``tp_N``: N workers, fixed; ``tp_Nr``: N workers, their slots releasing their pages (a budget of
1 MB); ``tp_auto``; ``tp_budget`` with the budget in MB last). A torchpipe loader's line also
says what the loader counted of itself (``memory``: ``held``, ``peak``, ``slot_pages``, ``shed``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

STEP_S = 0.01
SECONDS = 8.0
SHM_PATHS = (b"/dev/shm/", b"memfd:", b"/dev/zero", b"SYSV")
"""What a mapping or an open file of shared memory is named in ``/proc/<pid>/maps`` and ``fd/``."""
TORCH = {"torch_0": 0, "torch_1": 1, "torch_2": 2}


def _workload(name: str) -> Any:
    """The workload's dataset (as bench/workloads.py makes it) and its batch counter."""
    from bench import data, workloads

    if name == "jpeg":
        return workloads.Mapped(
            workloads.JpegSample(data.jpeg_files(1024)), 10**7
        ), workloads._count_items
    if name == "tfrecord":
        import torchpipe as tp
        from bench import tfrecord

        records = tp.io.TFRecordRecords(tfrecord.tfrecord_shards(1024))
        return workloads.Mapped(tfrecord.RecordSample(records), 10**7), workloads._count_items
    return workloads.Mapped(workloads.big_tensor, 10**7), workloads._count_gigabytes


def _own_shm(pid: int, found: dict[tuple[int, int], int]) -> None:
    """The shared-memory files process ``pid`` maps or holds open, by inode: their allocated bytes
    (a file's pages given back or never written are not)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            ranges = [
                parts[0].decode()
                for parts in (line.split(None, 5) for line in f)
                if len(parts) == 6 and any(k in parts[5] for k in SHM_PATHS)
            ]
        paths = [f"/proc/{pid}/map_files/{r}" for r in ranges]
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if any(k in os.readlink(f"/proc/{pid}/fd/{fd}").encode() for k in SHM_PATHS):
                    paths.append(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
    except OSError:
        return
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        found[(st.st_dev, st.st_ino)] = st.st_blocks * 512


def count_own_shm() -> None:
    """Make :class:`bench.measure.TreeMonitor` count the tree's own shared memory (what its
    processes map or hold open) instead of the machine's growth (others' included)."""
    import psutil

    from bench.measure import TreeMonitor

    def pss_and_held(self: Any) -> tuple[float | None, float | None]:
        fields = self._rollup(b"Pss:", b"Pss_Shmem:")
        if fields is None:
            return None, None
        try:
            processes = [self._root] + self._root.children(recursive=True)
        except psutil.Error:
            return fields[b"Pss:"], None
        found: dict[tuple[int, int], int] = {}
        for process in processes:
            _own_shm(process.pid, found)
        return fields[b"Pss:"], fields[b"Pss:"] - fields[b"Pss_Shmem:"] + sum(found.values())

    TreeMonitor.pss_and_held = pss_and_held  # type: ignore[method-assign]


def trial(name: str, config: str, budget_mb: float | None) -> dict[str, Any]:
    """One configuration of workload ``name`` in this process: its peak growth of held memory
    (MB over the tree before the loader), its throughput, and what its memory report says."""
    import torchpipe as tp
    from bench.measure import TreeMonitor, release_memory

    if os.environ.get("BUDGET_PEAK_OWN_SHM"):
        count_own_shm()
    step = float(os.environ.get("BUDGET_PEAK_STEP_MS", STEP_S * 1000)) / 1000
    dataset, count = _workload(name)
    release_memory()
    with TreeMonitor() as monitor:
        before = monitor.held() or 0.0
        if config in TORCH:
            loader: Any = torch.utils.data.DataLoader(
                dataset, batch_size=64, num_workers=TORCH[config]
            )
        elif config.startswith("tp_") and config[3:].isdigit():  # tp_2: num_workers=2, fixed
            loader = tp.DataLoader(dataset, batch_size=64, num_workers=int(config[3:]))
        elif config.startswith("tp_") and config[3:-1].isdigit():  # tp_2r: slots released
            released = tp.AutotuneOptions(ram_budget=2**20)
            loader = tp.DataLoader(
                dataset, batch_size=64, num_workers=int(config[3:-1]), autotune=released
            )
        else:
            options = (
                tp.AutotuneOptions(ram_budget=budget_mb * 2**20)
                if budget_mb
                else tp.AutotuneOptions()
            )
            loader = tp.DataLoader(dataset, batch_size=64, num_workers="auto", autotune=options)
        iterator = iter(loader)
        start, units, first = time.perf_counter(), 0.0, None
        for batch in iterator:
            now = time.perf_counter()
            if first is None and now - start > 2.0:
                first, units = now, 0.0  # two seconds of start-up, then the window
            units += count(batch)[1]  # held while the next comes, as in a training loop
            if step:
                time.sleep(step)
            if now - start > SECONDS:
                break
        elapsed = time.perf_counter() - (first or start)
        memory, where = None, None
        if hasattr(loader, "stats"):
            found = loader.stats()
            memory = found[0].get("memory") if found else None
            where = f"{found[0].get('executor')} x{found[0].get('workers')}" if found else None
        if hasattr(iterator, "close"):
            iterator.close()
        elif hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
    peak = max(monitor.peak_held or 0.0, before)
    return {
        "peak_mb": (peak - before) / 2**20,
        "throughput": units / elapsed,
        "memory": memory,
        "where": where,
        "peak_parts": monitor.peak_parts,
    }


def _run(name: str, config: str, budget_mb: float | None = None) -> dict[str, Any]:
    args = [sys.executable, "-m", "bench.budget_peak", "--trial", name, config, str(budget_mb or 0)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=180, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def compare(name: str, repeat: int) -> dict[str, Any]:
    """The medians of ``repeat`` runs of each configuration, and the budgeted loader's verdict."""
    found = {config: [_run(name, config) for _ in range(repeat)] for config in [*TORCH, "tp_auto"]}
    base, unconstrained = _median(found["torch_0"], "peak_mb"), _median(found["tp_auto"], "peak_mb")
    budget = (unconstrained - base) / 2 + base  # the tree's growth it must peak within
    found["tp_budget"] = [_run(name, "tp_budget", budget - base) for _ in range(repeat)]
    fits = [c for c in TORCH if _median(found[c], "peak_mb") <= budget]
    best = max(fits, key=lambda c: _median(found[c], "throughput"), default=None)
    rows = {
        c: {"peak_mb": _median(r, "peak_mb"), "throughput": _median(r, "throughput")}
        for c, r in found.items()
    }
    budgeted = rows["tp_budget"]
    return {
        "workload": name,
        "budget_mb": budget,
        "ram_budget_mb": budget - base,
        "rows": rows,
        "peak_over_budget": [round(r["peak_mb"] / budget, 3) for r in found["tp_budget"]],
        "best_torch_fitting": best,
        "speed_vs_best": budgeted["throughput"] / rows[best]["throughput"] if best else None,
        "memory": found["tp_budget"][-1]["memory"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["jpeg", "bigtensor"])
    parser.add_argument("--trial", nargs=3, metavar=("WORKLOAD", "CONFIG", "BUDGET_MB"))
    parser.add_argument("--step-ms", type=float, default=STEP_S * 1000, help="the loop's step")
    parser.add_argument("--own-shm", action="store_true", help="count the tree's own shm only")
    args = parser.parse_args()
    os.environ["BUDGET_PEAK_STEP_MS"] = str(args.step_ms)  # the trials' processes read them
    if args.own_shm:
        os.environ["BUDGET_PEAK_OWN_SHM"] = "1"
    if args.trial:
        name, config, budget = args.trial
        print(json.dumps(trial(name, config, float(budget) or None)))
        return
    for name in args.workloads:
        print(json.dumps(compare(name, args.repeat), indent=1), flush=True)


if __name__ == "__main__":
    main()

"""Grid points a ``--quick`` run leaves out: those that never won in the last three full runs (issue #57).

A full ``--quick --repeat 3`` must fit in 45 minutes on the 2-core machine without shortening the
windows, so each grid (torch's DataLoader grid, torchpipe's by hand, each peer's) keeps, on each
workload, only the points that were its best in at least one of the last three recorded runs
(``docs/img/bench_quick.json`` at 1bc3b20, df1a3cb and ecd3ba9, all on 2 usable cores):
:data:`WON`. A grid with no record there (the peers on ``blobs``, which had no rows before) keeps
every point, and so does a run on another number of cores (the points would not be the same) or
without ``--quick``. Some DataLoader points stay whether they won or not (:func:`kept`): the
memory targets read torch at the zero-knob rows' worker counts, and the budgeted loader the
fastest grid point within its budget, so the points that were that reference in one of the same
three runs stay too (:data:`BUDGET_WON`). ``bench/run.py`` records what it left out
(``workloads.<name>.cut``).
"""

from __future__ import annotations

from typing import Any

from torchpipe.runtime.cpu import usable_cpu_count

CORES = 2
"""The usable cores the runs in :data:`WON` were measured on."""
_T, _P = "thread", "process"
WON: dict[str, dict[str, list[dict[str, Any]]]] = {
    "jpeg": {
        "dataloader_best": [
            {"num_workers": 2, "prefetch_factor": 4},
            {"num_workers": 4, "prefetch_factor": 2},
        ],
        "torchpipe_best": [{"num_parallel_calls": 2, "executor": _P}],
        "nodes_best": [{"num_workers": 2, "method": _P}],
        "spdl_best": [{"concurrency": 2, "executor": _P}],
        "grain_best": [{"workers": 4, "kind": _T}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"}],
    },
    "bigtensor": {
        "dataloader_best": [{"num_workers": 0}, {"num_workers": 4, "prefetch_factor": 2}],
        "torchpipe_best": [
            {"num_parallel_calls": 2, "executor": _T},
            {"num_parallel_calls": 4, "executor": _P},
        ],
        "nodes_best": [{"num_workers": 4, "method": _T}],
        "spdl_best": [{"concurrency": 4, "executor": _T}],
        "grain_best": [{"workers": 4, "kind": _T}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"}],
    },
    "tiny": {
        "dataloader_best": [{"num_workers": 0}, {"num_workers": 2, "prefetch_factor": 4}],
        "torchpipe_best": [{"num_parallel_calls": 2, "executor": _P}],
        "nodes_best": [{"num_workers": 2, "method": _P}],
        "spdl_best": [{"concurrency": 2, "executor": _P}],
        "grain_best": [{"workers": 2, "kind": _P}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"}],
    },
    "records": {
        "dataloader_best": [{"num_workers": 0}],
        "torchpipe_best": [{"num_parallel_calls": None, "executor": _T}],
        "nodes_best": [{"num_workers": 4, "method": _T}],
        "spdl_best": [{"concurrency": 4, "executor": _T}],
        "grain_best": [{"workers": 4, "kind": _T}],
        "tfdata_best": [
            {"function": "numpy_function", "num_parallel_calls": 4},
            {"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"},
        ],
    },
    "blobs": {
        "dataloader_best": [{"num_workers": 0}],
        "nodes_best": [{"num_workers": 4, "method": _T}],
        "spdl_best": [{"concurrency": 4, "executor": _T}],
        "grain_best": [{"workers": 4, "kind": _T}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"}],
    },
    "text": {
        "dataloader_best": [
            {"num_workers": 2, "prefetch_factor": 2},
            {"num_workers": 2, "prefetch_factor": 4},
            {"num_workers": 3, "prefetch_factor": 2},
        ],
        "torchpipe_best": [{"num_parallel_calls": 2, "executor": _P}],
        "nodes_best": [{"num_workers": 2, "method": _P}],
        "spdl_best": [{"concurrency": 2, "executor": _P}],
        "grain_best": [{"workers": 2, "kind": _P}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": 4}],
    },
    "latency": {
        "dataloader_best": [{"num_workers": 4, "prefetch_factor": 2}],
        "torchpipe_best": [{"num_parallel_calls": 16, "executor": _P}],
        "nodes_best": [{"num_workers": 64, "method": _T}],
        "spdl_best": [{"concurrency": 64, "executor": _T}],
        "grain_best": [{"workers": 16, "kind": _P}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": 64}],
    },
    "cache": {
        "dataloader_best": [
            {"num_workers": 2, "prefetch_factor": 2},
            {"num_workers": 2, "prefetch_factor": 4},
        ],
        "nodes_best": [{"num_workers": 4, "method": _T}, {"num_workers": 2, "method": _P}],
        "spdl_best": [{"concurrency": 4, "executor": _T}, {"concurrency": 2, "executor": _P}],
        "grain_best": [{"workers": 4, "kind": _T}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"}],
    },
    "tfrecord": {
        "dataloader_best": [
            {"num_workers": 2, "prefetch_factor": 2},
            {"num_workers": 4, "prefetch_factor": 2},
        ],
        "torchpipe_best": [{"num_parallel_calls": 2, "executor": _P}],
        "nodes_best": [{"num_workers": 2, "method": _P}],
        "spdl_best": [{"concurrency": 2, "executor": _P}],
        "grain_best": [{"workers": 4, "kind": _T}],
        "tfdata_best": [{"function": "numpy_function", "num_parallel_calls": "AUTOTUNE"}],
    },
}
"""Each workload's grids: the points that were the grid's best in one of the last three runs."""
# The training-transform workloads (bench/training.py, issue #61) have no recorded runs: each keeps
# the points that won on the workload whose data it reads, in the same three runs (jpeg's files,
# tfrecord's shards), so each peer's grid there is one point and the rows stay affordable.
WON["train_jpeg"] = WON["jpeg"]
WON["train_tfrecord"] = WON["tfrecord"]
REFERENCE_WORKERS = (0, 2)
"""torch's DataLoader at these workers (``prefetch_factor=2``) is always measured: the zero-knob
rows ran inline, on threads or on 2 processes in every run of the last three (bigtensor's on 4
once, which won there too), and the memory targets read torch at the same workers."""
BUDGET_WON: dict[str, list[dict[str, Any]]] = {
    "jpeg": [{"num_workers": 2, "prefetch_factor": 4}, {"num_workers": 3, "prefetch_factor": 2}],
    "bigtensor": [{"num_workers": 0}],
    "tfrecord": [{"num_workers": 2, "prefetch_factor": 2}],
}
"""The DataLoader points that were the budgeted loader's reference (the fastest grid point within
its budget, ``bench/run.py``'s ``BUDGETED``) in one of the last three runs."""


def kept(workload: str, best: str, knobs: Any, quick: bool) -> bool:
    """Whether a ``--quick`` run measures the grid point ``knobs`` of ``best`` on ``workload``."""
    if not quick or usable_cpu_count() != CORES:
        return True
    won = WON.get(workload, {}).get(best)
    if won is None or knobs in won:
        return True
    if best == "dataloader_best":
        reference = (
            knobs.get("num_workers") in REFERENCE_WORKERS and knobs.get("prefetch_factor", 2) == 2
        )
        return reference or knobs in BUDGET_WON.get(workload, [])
    return False

"""The bench's verdict machinery (issue #57): the noise floor, a fresh process per row, memory at its
peak, convergence, data that outlasts its window, and a failure that does not end the run."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest

from bench import cuts, isolate, rounds, run
from bench import peers as pr
from bench import targets as tg
from bench import workloads as wl
from bench.measure import TreeMonitor, converge_s, measure
from tests.test_bench import TINY, _fake_peer, small  # noqa: F401 - the fixture, used by name

MB = 2**20
HELD_MB = 200


def _row(throughput: float, where: str | None = None) -> dict[str, Any]:
    return {"throughput": throughput, "where": where, "peak_held_mb": 100.0, "converge_s": 0.8}


def test_a_row_identical_to_the_best_does_not_miss_and_one_below_the_floor_does():
    # dataloader_best's configuration measured as three twins: medians 92, 97, 100 -> floor 0.92
    results = {
        "dataloader_best": _row(100.0),
        "torchpipe_best": _row(100.0),
        "dataloader_best_twin1": _row(92.0),
        "dataloader_best_twin2": _row(97.0),
        "dataloader_best_twin3": _row(100.0),
        "torchpipe_auto": _row(92.0, "inline"),  # as the lowest twin: the best row, measured again
        "torchpipe_dataloader_auto": _row(91.0, "inline"),
    }
    noise = tg.floor(results)
    assert noise is not None and noise["ratio"] == pytest.approx(0.92)
    checks = tg.targets("tiny", results)
    same, below = checks["torchpipe_auto"], checks["torchpipe_dataloader_auto"]
    for key in ("vs_best_of_any", "vs_dataloader_best"):
        assert same[key]["ratio"] == pytest.approx(0.92) and same[key]["met"] is True, same[
            key
        ]  # below 0.95 / 1.0
        assert (
            same[key]["floor"] == pytest.approx(0.92) and below[key]["met"] is False
        )  # 0.91: below both
    # only the throughput checks against the best rows
    assert "floor" not in same["vs_best_python_peer"]
    # a quiet machine's floor above the bound does not raise the bound
    quiet = {
        **results,
        "dataloader_best_twin1": _row(99.0),
        "dataloader_best_twin2": _row(99.0),
        "torchpipe_auto": _row(96.0, "inline"),
    }
    assert (
        tg.targets("tiny", quiet)["torchpipe_auto"]["vs_best_of_any"]["met"] is True
    )  # 0.96 >= 0.95
    assert tg.floor({"dataloader_best_twin1": _row(5.0)}) is None  # one twin: no floor
    text = tg.format_targets({"workloads": {"tiny": {"results": results, "targets": checks}}})
    assert "0.92 ok (floor 0.92)" in text and "0.91 MISS (floor 0.92)" in text


def test_converge_s_is_the_end_of_the_first_half_second_at_the_steady_rate():
    # 10 units/s from 1 s on, nothing before: the first window at the rate ends 0.5 s after it starts
    times = [1.0 + 0.1 * k for k in range(40)]
    assert converge_s(times, [1.0] * 40, 10.0) == pytest.approx(1.5)
    assert converge_s(times, [1.0] * 40, 20.0) is None  # never within 10% of twice its rate
    # at the rate from iter() on: the first window, iter() to 0.5 s
    assert converge_s([0.1 * k for k in range(1, 20)], [1.0] * 19, 10.0) == pytest.approx(0.5)
    assert converge_s([], [], 10.0) is None and converge_s([1.0], [1.0], 0.0) is None


def _leaking(kept: list[np.ndarray], megabytes: int) -> itertools.repeat[tuple[int, float]]:
    """A loader that leaves ``megabytes`` of heap behind in this process (``kept``), as a row's
    workers, imports or caches would."""
    if megabytes:
        kept.append(np.ones(megabytes * MB, dtype=np.uint8))
    return itertools.repeat((1, 1.0))


def _two_rows(fresh: bool) -> dict[str, float]:
    kept: list[np.ndarray] = []
    count = lambda batch: batch  # noqa: E731 - the batch is its own count

    def row(megabytes: int) -> Any:
        return lambda: measure(lambda: _leaking(kept, megabytes), count, 0.0, 0.05, min_batches=1)

    def plan() -> list[rounds.Trial]:
        return [
            rounds.Trial("leaks", row(HELD_MB), name="leaks"),
            rounds.Trial("after", row(0), name="after"),
        ]

    try:
        done = rounds.run_rounds(plan, 1, fresh=fresh)
    finally:
        kept.clear()
    return {key: runs[0]["peak_held_mb"] for key, runs in done.runs.items()}


def test_a_rows_memory_does_not_depend_on_the_rows_before_it():
    """Forked from a parent that ran no row, the second row's peak does not hold the first's heap;
    run one after another in one process (``fresh=False``), it does."""
    fresh = _two_rows(fresh=True)
    assert fresh["leaks"] - fresh["after"] > HELD_MB * 0.75, fresh
    shared = _two_rows(fresh=False)
    assert shared["after"] > shared["leaks"] - HELD_MB * 0.25, shared


def test_a_row_that_fails_is_recorded_and_the_others_are_measured():
    def broken() -> dict[str, Any]:
        raise RuntimeError("no such device")

    def plan() -> list[rounds.Trial]:
        return [
            rounds.Trial("broken", broken, name="broken"),
            rounds.Trial("fine", lambda: {"throughput": 1.0}, name="fine"),
        ]

    seen: list[str] = []
    done = rounds.run_rounds(plan, 2, on_error=lambda trial, e: seen.append(str(e).splitlines()[0]))
    assert set(done.runs) == {"fine"} and len(done.runs["fine"]) == 2
    assert [f.split(":", 1)[0] for f in done.failed["broken"]] == ["round 0", "round 1"]
    assert "RuntimeError: no such device" in done.failed["broken"][0] and len(seen) == 2
    runs = done.runs["fine"]
    # the fresh process's cost, apart
    assert all(r["row_wall_s"] >= r["measure_s"] >= 0 for r in runs)
    with pytest.raises(isolate.RowFailed, match="ran past") as info:
        isolate.in_fresh_process([lambda: time.sleep(30)], timeout_s=0.5)
    assert "where its threads were" in str(info.value) and "test_bench_verdicts.py" in str(
        info.value
    )


def test_a_row_past_its_time_is_killed_and_recorded_with_where_it_was():
    def hangs() -> dict[str, Any]:
        time.sleep(30)
        return {"throughput": 1.0}

    def plan() -> list[rounds.Trial]:
        return [
            rounds.Trial("hangs", hangs, name="hangs"),
            rounds.Trial("fine", lambda: {"throughput": 1.0}, name="fine"),
        ]

    done = rounds.run_rounds(plan, 1, timeout_s=0.5)
    assert set(done.runs) == {"fine"}
    (failure,) = done.failed["hangs"]
    assert "ran past 0.5 s" in failure and "in hangs" in failure  # the stack of the hung row


def test_a_known_allocation_held_for_200_ms_shows_in_the_peak():
    # Read on PSS, the held figure without the machine's shared memory: other processes (the
    # suite's other workers) make and drop shared memory meanwhile, and held counts theirs too.
    with TreeMonitor() as monitor:
        before = monitor.pss_and_held()[0]
        block = np.ones(HELD_MB * MB, dtype=np.uint8)  # written: its pages are resident
        held_from, start = monitor.samples, time.perf_counter()
        # held 200 ms, and until the sampler has read the tree at least twice meanwhile (a loaded
        # machine may run its thread late: what must hold is a reading while the block is held)
        while time.perf_counter() - start < 0.2 or monitor.samples < held_from + 2:
            assert time.perf_counter() - start < 30, "the sampler did not run"
            time.sleep(0.01)
        del block
        after = monitor.pss_and_held()[0]
    assert before is not None and after is not None and monitor.peak_pss is not None
    assert (monitor.peak_pss - before) / MB > HELD_MB * 0.9  # in the peak
    # and gone at the end: an end reading would miss it
    assert (after - before) / MB < HELD_MB * 0.5
    assert monitor.sampler_cpu_s > 0


def test_data_that_runs_out_is_said_not_raised_past(monkeypatch):
    count = lambda batch: (1, 1.0)  # noqa: E731
    result = measure(lambda: iter(range(40)), count, 0.0, 60.0, min_batches=1)
    assert result["ended_early"] is True and result["throughput"] > 0  # inside the window: reported
    with pytest.raises(RuntimeError, match="ran out in the warm-up"):
        measure(lambda: iter(range(3)), count, 60.0, 1.0)
    full = measure(lambda: itertools.repeat(0), count, 0.0, 0.05)
    assert full["ended_early"] is False and full["converge_s"] > 0
    assert len(wl.tiny_elements(TINY, True).dataset) >= wl.TIMED_ELEMENTS  # whatever the sizes say


def test_a_peer_without_a_configuration_on_a_workload_says_why(small, monkeypatch):
    peer = _fake_peer("empty", [], [])
    monkeypatch.setattr(
        pr,
        "PEERS",
        (peer.__class__(peer.library, peer.module, peer.distribution, lambda work, quick: []),),
    )
    monkeypatch.setattr(pr.Peer, "installed", lambda self: True)
    runner = run.Runner(wl.blobs(TINY, True), TINY, quick=True)
    assert runner.peer_trials(last=False) == [] and runner.not_measured == {
        "empty": run.NOT_MEASURED_GRID
    }
    # blobs gives the peers a grid: they have rows there
    assert pr.grid_of(wl.blobs(TINY, True), quick=True)


def test_a_quick_run_leaves_out_the_grid_points_that_never_won(small, monkeypatch):
    monkeypatch.setattr(cuts, "usable_cpu_count", lambda: cuts.CORES)
    monkeypatch.setattr(
        cuts,
        "WON",
        {
            "tiny": {
                "dataloader_best": [{"num_workers": 3, "prefetch_factor": 2}],
                "torchpipe_best": [{"num_parallel_calls": 4, "executor": "thread"}],
            }
        },
    )
    assert cuts.kept(
        "tiny", "dataloader_best", {"num_workers": 3, "prefetch_factor": 2}, quick=True
    )
    assert not cuts.kept(
        "tiny", "dataloader_best", {"num_workers": 4, "prefetch_factor": 2}, quick=True
    )
    assert cuts.kept(
        "tiny", "dataloader_best", {"num_workers": 2, "prefetch_factor": 2}, quick=True
    )  # a reference
    assert cuts.kept(
        "jpeg", "dataloader_best", {"num_workers": 4, "prefetch_factor": 2}, quick=True
    )  # no record
    assert cuts.kept(
        "tiny", "dataloader_best", {"num_workers": 4, "prefetch_factor": 2}, quick=False
    )  # full grids
    monkeypatch.setattr(cuts, "BUDGET_WON", {"tiny": [{"num_workers": 4, "prefetch_factor": 2}]})
    assert cuts.kept(
        "tiny", "dataloader_best", {"num_workers": 4, "prefetch_factor": 2}, quick=True
    )  # a budget's
    monkeypatch.setattr(
        run,
        "dataloader_grid",
        lambda quick: [{"num_workers": n, "prefetch_factor": 2} for n in (1, 3)],
    )
    runner = run.Runner(wl.tiny_elements(TINY, True), TINY, quick=True)
    assert [t.knobs for t in runner.dataloader_trials()[1:]] == [
        {"num_workers": 3, "prefetch_factor": 2}
    ]
    assert runner.cut == [
        "dataloader_best {'num_workers': 1, 'prefetch_factor': 2}"
    ]  # recorded, once
    runner.dataloader_trials()
    assert len(runner.cut) == 1

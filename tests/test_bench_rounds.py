"""Tests of ``bench/run.py --repeat``: rounds that alternate the configurations (``bench/rounds.py``),
each configuration's median, spread and runs, a grid's best by median, and ratios from medians."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

import torchpipe as tp
from bench import markdown, rounds, run
from tests.test_bench import TINY, small  # noqa: F401 - the fixture, used by name


def _run(throughput: float, **more: Any) -> dict[str, Any]:
    return {
        "throughput": throughput,
        "first_batch_s": 0.1,
        "peak_rss_mb": 10.0,
        "end_pss_mb": 5.0,
        "cpu_s_per_item": 1e-3,
        "others_cpu_share": 0.0,
        "where": None,
        "placement": None,
        **more,
    }


def test_rounds_alternate_the_configurations_and_plan_each_round_afresh():
    order, plans = [], []

    def plan() -> list[rounds.Trial]:
        plans.append(len(plans))
        return [
            rounds.Trial(key, lambda key=key: order.append(key) or _run(1.0), name=key)
            for key in "ABC"
        ]

    done = rounds.run_rounds(plan, 3, fresh=False)  # the order is seen here
    assert order == list("ABCABCABC") and plans == [0, 1, 2]
    assert {key: len(runs) for key, runs in done.runs.items()} == {"A": 3, "B": 3, "C": 3}
    with pytest.raises(ValueError, match="at least 1"):
        rounds.run_rounds(plan, 0)
    with pytest.raises(ValueError, match="duplicate"):
        rounds.run_rounds(lambda: [rounds.Trial("A", lambda: _run(1.0))] * 2, 1)


def test_a_summary_is_the_median_of_its_runs_with_their_spread_and_every_run_kept():
    runs = [
        _run(100.0, end_pss_mb=None, where="thread x2", epoch_rates=[10.0, 40.0]),
        _run(130.0, end_pss_mb=200.0, where="process x2", epoch_rates=[30.0, 20.0]),
        _run(90.0, end_pss_mb=180.0, where="inline", cpu_s_per_item=3e-3, epoch_rates=[20.0, 30.0]),
    ]
    summary = rounds.summarize(runs)
    # (130 - 90) / 100
    assert summary["throughput"] == 100.0 and summary["spread"] == pytest.approx(0.4)
    assert summary["end_pss_mb"] == 190.0  # the runs that could read it
    assert summary["cpu_s_per_item"] == 1e-3 and summary["epoch_rates"] == [
        20.0,
        30.0,
    ]  # each epoch on its own
    assert summary["where"] == "thread x2"  # the median run's
    assert [r["throughput"] for r in summary["runs"]] == [100.0, 130.0, 90.0]
    assert summary["runs"][1]["where"] == "process x2"
    assert rounds.summarize([_run(7.0)])["spread"] == 0.0
    with pytest.raises(ValueError, match="no runs"):
        rounds.summarize([])


def test_a_grids_best_is_the_point_with_the_best_median_and_a_failing_group_is_dropped():
    values = {"steady": iter([100.0, 101.0, 99.0]), "lucky": iter([300.0, 90.0, 95.0])}

    def plan() -> list[rounds.Trial]:
        def broken() -> dict[str, Any]:
            raise RuntimeError("no such device")

        return [
            rounds.Trial(
                f"grid {knob}",
                lambda knob=knob: _run(next(values[knob])),
                best_of="x_best",
                knobs={"knob": knob},
            )
            for knob in values
        ] + [
            rounds.Trial("peer a", lambda: _run(1e9), name="peer_zero", group="peer"),
            rounds.Trial("peer b", broken, group="peer"),
        ]

    failed = []
    done = rounds.run_rounds(
        plan, 3, on_error=lambda trial, e: failed.append((trial.key, str(e))), fresh=False
    )
    results, chosen = rounds.report(done)
    assert chosen == {
        "x_best": {"knob": "steady"}
    }  # median 100 beats median 95 despite one run of 300
    assert results["x_best"]["throughput"] == 100.0 and set(results) == {
        "x_best"
    }  # the failed peer: no rows
    assert done.errors == {"peer": "RuntimeError: no such device"} and failed == [
        ("peer b", "no such device")
    ]


class _FakeMeasure:
    """``bench/run.py``'s measure, replaced: it logs which configuration each call was given (read
    from the ``partial`` that makes its loader, so nothing is built) and returns the next of that
    configuration's scripted throughputs."""

    RATES: ClassVar[dict[str, list[int]]] = {
        "torch0": [50, 60, 40],
        "torch1": [100, 140, 90]
        + [100, 95, 105, 98, 102, 99, 101, 97, 100],  # the grid's, then its twins
        "tp_auto": [120, 80, 110],
        "dsl_auto": [90, 300, 85],
        "dsl_grid": [95, 90, 300],
        "tp_dl": [100, 100, 100],
    }

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, make: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if make.func is run.torch_loader:
            kind = f"torch{make.args[1]['num_workers']}"
        elif make.func is run.dsl_pipeline:
            kind = "dsl_auto" if make.args[1] is tp.AUTOTUNE else "dsl_grid"
        else:
            kind = "tp_auto" if make.keywords["num_workers"] == "auto" else "tp_dl"
        rate = self.RATES[kind][self.calls.count(kind)]
        self.calls.append(kind)
        return _run(float(rate), where=None if kind.startswith("torch") else "thread x2")


def test_repeat_alternates_a_workloads_configurations_and_takes_every_ratio_from_medians(
    small, monkeypatch
):
    fake = _FakeMeasure()
    monkeypatch.setattr(run, "measure", fake)
    report = run.run_all(["tiny"], quick=True, sizes=TINY, repeat=3)
    # torch's grid in rounds of its own, then every other configuration once a round (the DSL twice:
    # auto and the grid's one point; torchpipe_dataloader with dataloader_best's arguments; its twins)
    assert (
        fake.calls
        == ["torch0", "torch1"] * 3
        + (["tp_auto", "dsl_auto", "dsl_grid", "tp_dl"] + ["torch1"] * 3) * 3
    )
    entry = report["workloads"]["tiny"]
    results = entry["results"]
    # torch1's median, not its best run (140)
    assert results["dataloader_best"]["throughput"] == 100.0
    assert report["machine"]["run"]["chosen"]["tiny"]["dataloader_best"] == {
        "num_workers": 1,
        "prefetch_factor": 2,
    }
    assert [r["throughput"] for r in results["torchpipe_dataloader_auto"]["runs"]] == [
        120.0,
        80.0,
        110.0,
    ]
    assert results["torchpipe_dataloader_auto"]["spread"] == pytest.approx(40 / 110)
    checks = entry["targets"]["torchpipe_dataloader_auto"]
    assert checks["vs_dataloader_best"]["ratio"] == pytest.approx(110 / 100)  # median over median
    # the twins' medians 100, 97, 100: the floor the throughput checks are read against
    assert entry["floor"]["ratio"] == pytest.approx(0.97) and checks["vs_dataloader_best"][
        "floor"
    ] == pytest.approx(0.97)
    assert checks["vs_best_of_any"]["against"] == "dataloader_best"  # torchpipe_best's median is 95
    assert entry["placement"]["torchpipe_dataloader_auto"]["runs"] == ["thread x2"] * 3
    assert report["machine"]["run"]["repeat"] == 3
    row = next(
        line for line in run.table(report).splitlines() if "torchpipe_dataloader_auto" in line
    )
    assert row.split()[2:6] == [
        "110",
        "elem/s",
        "36%",
        "1.10x",
    ]  # the median, its spread, median over median
    summary = markdown.summary_table(report).splitlines()[2]
    ratios = "0.90x (spread 239%) | 1.10x (spread 36%) | - | 0.97 | - / - | - / -"  # no peak, no converge faked
    assert summary == f"| tiny | 100 elem/s (1 worker) (spread 50%) | {ratios} |"


def test_the_cli_rejects_a_repeat_below_one(capsys):
    with pytest.raises(SystemExit):
        run.main(["--workloads", "tiny", "--repeat", "0"])
    assert "--repeat must be at least 1" in capsys.readouterr().err

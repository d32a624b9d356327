"""Tests of ``bench/noise.py``: one configuration measured as twins in alternating rounds, and each
twin's median against the highest (what a row identical to the best reads on this machine)."""

from __future__ import annotations

import json

import pytest

from bench import noise, run
from bench import workloads as wl
from tests.test_bench import TINY, small  # noqa: F401 - the fixture, used by name


def test_each_twin_is_its_median_over_the_highest_twins_median():
    found = noise.floor(
        {"a": [100.0, 100.0, 100.0], "b": [90.0, 96.0, 100.0], "c": [80.0, 94.0, 99.0]}
    )
    assert found["medians"] == {"a": 100.0, "b": 96.0, "c": 94.0}
    assert found["ratios"] == {"a": 1.0, "b": 0.96, "c": 0.94}
    assert found["lowest"] == 0.94 and found["median_ratio"] == 0.96
    assert (
        found["at_target"] == pytest.approx(2 / 3) and found["target"] == 0.95
    )  # the best of any's bound
    assert found["spreads"]["a"] == 0.0 and found["spreads"]["c"] == pytest.approx(19 / 94)
    assert noise.floor({"a": [1.0], "b": [2.0]}, target=0.4)["at_target"] == 1.0
    with pytest.raises(ValueError, match="at least two twins"):
        noise.floor({"a": [1.0]})
    with pytest.raises(ValueError, match="each with runs"):
        noise.floor({"a": [1.0], "b": []})


def test_twins_are_rounds_of_one_dataloader_configuration(small, monkeypatch):
    measured = []
    measure = run.measure

    def logged(make, *args, **kwargs):
        loader = make()
        measured.append((loader.num_workers, loader.prefetch_factor))
        return measure(lambda: loader, *args, **kwargs)

    monkeypatch.setattr(run, "measure", logged)
    report = noise.run_noise(["tiny"], TINY, twins=3, repeat=2, num_workers=1)
    assert report["machine"]["run"]["twins"] == 3 and report["machine"]["run"]["repeat"] == 2
    entry = report["workloads"]["tiny"]
    assert measured == [(1, 2)] * 6  # one configuration, each twin once a round
    assert {key: len(runs) for key, runs in entry["runs"].items()} == {
        "twin0": 2,
        "twin1": 2,
        "twin2": 2,
    }
    assert (
        max(entry["ratios"].values()) == 1.0 and 0 < entry["lowest"] <= entry["median_ratio"] <= 1.0
    )
    assert 1 / 3 <= entry["at_target"] <= 1.0 and entry["unit"] == "elem/s"
    assert "tiny" in noise.format_floor(report)
    with pytest.raises(ValueError, match="at least 2"):
        noise.twin_trials(wl.tiny_elements(TINY, True), TINY, 1, 0)
    with pytest.raises(ValueError, match="at least 0"):
        noise.twin_trials(wl.tiny_elements(TINY, True), TINY, 2, -1)


def test_cli_writes_json_and_refuses_what_it_cannot_run(small, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(wl, "QUICK", TINY)
    path = tmp_path / "noise.json"
    noise.main(
        [
            "--workloads",
            "records",
            "--twins",
            "2",
            "--repeat",
            "1",
            "--num-workers",
            "0",
            "--json",
            str(path),
        ]
    )
    report = json.loads(path.read_text())
    assert set(report["workloads"]["records"]["runs"]) == {"twin0", "twin1"}
    assert "at >= target" in capsys.readouterr().out
    for argv, error in (
        (["--workloads", "nope"], "unknown workloads"),
        (["--twins", "1"], "--twins must be"),
    ):
        with pytest.raises(SystemExit):
            noise.main(argv)
        assert error in capsys.readouterr().err

"""Smoke test of the benchmark suite: every workload and configuration, tiny sizes, end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import data
from bench import plot
from bench import run
from bench import targets as tg
from bench import workloads as wl

TINY = wl.Sizes(jpeg_files=8, text_docs=20, tiny_elements=4096, shard_records=32, cache_files=8,
                warmup_s=0.0, seconds=0.02, limit_s=0.02)  # fmt: skip
CONFIGS = {"dataloader_default", "dataloader_best", "torchpipe_dataloader", "torchpipe_dataloader_auto",
           "torchpipe_auto", "torchpipe_best"}
CACHE_CONFIGS = {"dataloader_default", "dataloader_best", "torchpipe_dataloader_auto", "torchpipe_cache_epoch1",
                 "torchpipe_cache_epoch2"}
KEYS = {"throughput", "first_batch_s", "peak_rss_mb", "end_pss_mb", "cpu_s_per_item", "others_cpu_share"}


@pytest.fixture
def small(monkeypatch, tmp_path):
    """Data in a temporary cache directory; one-point grids so the whole suite runs in seconds."""
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(run, "dataloader_grid", lambda quick: [{"num_workers": 1, "prefetch_factor": 2}])
    monkeypatch.setattr(wl, "_map_grid", lambda inline=False: [(2, "thread")])
    monkeypatch.setattr(wl, "latency_grid", lambda quick: [(4, "thread")])
    return tmp_path


def test_every_workload_and_configuration_end_to_end(small, capsys):
    report = run.run_all(list(wl.WORKLOADS), quick=True, sizes=TINY)
    assert set(report["workloads"]) == set(wl.WORKLOADS)
    for name, entry in report["workloads"].items():
        peers = {"tf_data"} if name == "tfrecord" else set()  # measured where TensorFlow is installed
        assert set(entry["results"]) - peers == (CACHE_CONFIGS if name == "cache" else CONFIGS), name
        assert isinstance(entry["unit"], str) and entry["limit"] > 0
        assert set(entry["targets"]) == set(tg.ZERO_KNOB)
        measured = entry["targets"]["torchpipe_dataloader_auto"]["vs_dataloader_best"]
        assert measured["ratio"] > 0 and isinstance(measured["met"], bool)
        for result in entry["results"].values():
            assert set(result) == KEYS
            assert result["throughput"] > 0 and result["peak_rss_mb"] > 0 and result["cpu_s_per_item"] >= 0
            assert result["end_pss_mb"] > 0, result  # Linux: smaps_rollup
            assert 0 <= result["others_cpu_share"] <= 1, result
    json.dumps(report)  # the document is plain JSON
    text = run.table(report)
    assert "torchpipe_best" in text and "vs DL best" in text and "torchpipe_dataloader_auto" in text
    assert report["workloads"]["records"]["extra"]["item_us"] > 0
    tfrecord = report["workloads"]["tfrecord"]["extra"]
    assert tfrecord["raw_reader_gbps"] > 0 and tfrecord["raw_batched_gbps"] > 0 and tfrecord["cat_gbps"] > 0


def test_cli_writes_json(small, tmp_path, monkeypatch):
    monkeypatch.setattr(wl, "QUICK", TINY)
    out = tmp_path / "out.json"
    run.main(["--quick", "--workloads", "tiny", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report) == {"machine", "workloads"}
    assert report["workloads"]["tiny"]["unit"] == "elem/s"
    assert report["machine"]["run"]["quick"] is True


def test_unknown_workload_is_rejected(capsys):
    with pytest.raises(SystemExit):
        run.main(["--workloads", "nope"])
    assert "unknown workloads" in capsys.readouterr().err


def test_data_is_deterministic_and_reused(small):
    first = data.jpeg_files(3)
    stamp = [open(p, "rb").read() for p in first]
    again = data.jpeg_files(3)
    assert again == first and [open(p, "rb").read() for p in again] == stamp
    docs, vocab = data.text_corpus(5)
    assert len(docs) == 5 and "[PAD]" == vocab[0]


def test_same_work_for_dataloader_and_torchpipe(small):
    work = wl.text(TINY, quick=True)
    ours = next(iter(work.batched(None, "thread")))
    theirs = next(iter(torch.utils.data.DataLoader(work.dataset, **work.loader_kwargs())))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert work.count(ours)[1] == float(ours[1].sum())


def test_records_rows_and_batches(small):
    work = wl.records(TINY, quick=True)
    rows = [work.dataset[i] for i in range(64)]
    assert set(rows[0]) == {"id", "label", "features", "blob", "meta"}
    sizes = {len(row["blob"]) for row in rows}
    low, high = wl.RECORD_BLOB_BYTES
    assert min(sizes) >= low and max(sizes) <= high and len(sizes) > 32  # sizes vary from row to row
    assert rows[5]["blob"] == work.dataset[5]["blob"] and rows[5]["id"] == "row-00000005"  # deterministic
    assert rows[0]["features"].dtype == np.float32 and rows[0]["features"].shape == (wl.RECORD_FEATURES,)
    assert rows[0]["meta"]["len"] == len(rows[0]["blob"])
    ours = next(iter(work.batched(2, "thread")))
    theirs = next(iter(torch.utils.data.DataLoader(work.dataset, **work.loader_kwargs())))
    assert ours["id"] == theirs["id"] and ours["blob"] == theirs["blob"]
    assert torch.equal(ours["features"], theirs["features"]) and torch.equal(ours["label"], theirs["label"])
    assert torch.equal(ours["meta"]["len"], theirs["meta"]["len"])
    assert [list(tags) for tags in theirs["meta"]["tags"]] == ours["meta"]["tags"]  # torch: tuples
    assert work.count(ours) == (32, 32.0)


def test_records_item_cost_is_small():
    # The workload is the cheap-records case: the issue sets an item cost under 20 us.
    assert wl.item_seconds(wl.Records(), 32, 0.15) < 20e-6


def _result(throughput: float, pss: float | None = 100.0) -> dict[str, float | None]:
    return {"throughput": throughput, "end_pss_mb": pss}


def test_targets_met_and_missed():
    results = {"dataloader_best": _result(100.0, 200.0), "torchpipe_best": _result(120.0),
               "torchpipe_auto": _result(114.0, 240.0), "torchpipe_dataloader_auto": _result(99.0, 241.0)}
    checks = tg.targets("jpeg", results, limit=1000.0)
    auto, loader = checks["torchpipe_auto"], checks["torchpipe_dataloader_auto"]
    assert set(auto) == {"vs_best_of_both", "vs_dataloader_best", "pss_vs_dataloader_best"}  # no limit target
    assert auto["vs_best_of_both"] == {"ratio": 0.95, "op": ">=", "target": 0.95, "met": True}
    assert auto["vs_dataloader_best"]["ratio"] == pytest.approx(1.14) and auto["vs_dataloader_best"]["met"]
    assert auto["pss_vs_dataloader_best"]["ratio"] == pytest.approx(1.2) and auto["pss_vs_dataloader_best"]["met"]
    assert loader["vs_best_of_both"]["met"] is False and loader["vs_dataloader_best"]["met"] is False
    assert loader["pss_vs_dataloader_best"]["met"] is False


def test_tiny_is_held_to_its_limit():
    results = {"dataloader_best": _result(100.0), "torchpipe_auto": _result(170.0),
               "torchpipe_dataloader_auto": _result(185.0)}
    checks = tg.targets("tiny", results, limit=200.0)
    assert checks["torchpipe_auto"]["vs_limit"]["ratio"] == pytest.approx(0.85)
    assert checks["torchpipe_auto"]["vs_limit"]["met"] is False
    assert checks["torchpipe_dataloader_auto"]["vs_limit"]["met"] is True
    assert checks["torchpipe_auto"]["vs_best_of_both"]["ratio"] == pytest.approx(1.7)  # no torchpipe_best


def test_targets_with_missing_configs_and_pss():
    results = {"dataloader_best": _result(100.0, None), "torchpipe_dataloader_auto": _result(105.0, 90.0)}
    checks = tg.targets("cache", results, limit=None)
    assert all(c["ratio"] is None and c["met"] is None for c in checks["torchpipe_auto"].values())
    loader = checks["torchpipe_dataloader_auto"]
    assert loader["pss_vs_dataloader_best"] == {"ratio": None, "op": "<=", "target": 1.2, "met": None}
    assert loader["vs_dataloader_best"]["met"] is True
    nothing = tg.targets("tiny", {"torchpipe_auto": _result(10.0)}, limit=None)["torchpipe_auto"]
    assert all(c["met"] is None for c in nothing.values())


def test_targets_printed():
    results = {"dataloader_best": _result(100.0, 200.0), "torchpipe_auto": _result(80.0, 200.0)}
    results["dataloader_best"]["others_cpu_share"] = 0.4
    report = {"workloads": {"tiny": {"results": results, "targets": tg.targets("tiny", results, limit=100.0)}}}
    text = tg.format_targets(report)
    row = next(line for line in text.splitlines() if line.startswith("tiny") and "torchpipe_auto" in line)
    assert row.split()[2:] == ["0.80", "MISS", "0.80", "MISS", "1.00", "ok", "0.80", "MISS"]
    loader_row = next(line for line in text.splitlines() if "torchpipe_dataloader_auto" in line)
    assert loader_row.split()[2:] == ["-"] * 4  # not measured
    assert "1 targets met, 3 missed" in text and "tiny/torchpipe_auto vs_limit" in text
    assert text.splitlines()[-1].endswith("cores: tiny/dataloader_best (40%)")


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    report = {"machine": {}, "workloads": {"tiny": {"unit": "elem/s", "limit": None, "results": {
        "dataloader_best": dict.fromkeys(KEYS, 1.0), "torchpipe_best": dict.fromkeys(KEYS, 2.0)}}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert plot.ratios(report) == {"tiny": {"dataloader_best": 1.0, "torchpipe_best": 2.0}}
    monkeypatch.setattr(plot, "_pyplot", lambda: None)
    with pytest.raises(SystemExit, match="matplotlib"):
        plot.main([str(path), "-o", str(tmp_path / "out.png")])


def test_plot_draws_every_configuration(tmp_path):
    plt = plot._pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    results = {config: dict.fromkeys(KEYS, 1.0 + k) for k, config in enumerate(run.ORDER)}
    report = {"workloads": {"records": {"results": results},
                            "cache": {"results": {"dataloader_best": results["dataloader_best"]}}}}
    table = plot.ratios(report)
    assert table["records"]["torchpipe_dataloader_auto"] == 4.0 / 2.0 and table["cache"] == {"dataloader_best": 1.0}
    plot.draw(table, "test", str(tmp_path / "out.png"), plt)
    assert (tmp_path / "out.png").stat().st_size > 0

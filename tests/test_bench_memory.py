"""Tests of the memory benchmarks: ``bench/cow.py`` (a dataset whose Python index forked workers
copy, as the process tree's PSS growth, with and without ``tp.SharedSequence``) and
``bench/soak.py`` (PSS epoch after epoch on persistent workers)."""

from __future__ import annotations

import json
import os

import pytest

from bench import cow, data, soak
from bench.measure import TreeMonitor


def test_what_the_tree_holds_counts_shared_memory_that_no_process_maps():
    # a queued batch of torch's DataLoader: a shared-memory file written and mapped by nobody. The
    # machine's shared memory is read, which other tests' rings move meanwhile: the file is large,
    # and one of three tries must see it whole.
    size, seen = 256 * 2**20, []
    for _ in range(3):
        with TreeMonitor() as monitor:
            pss, held = monitor.pss(), monitor.held()
            assert pss is not None and held is not None
            with open(f"/dev/shm/torchpipe-test-held-{os.getpid()}", "wb") as f:
                try:
                    f.write(b"\1" * size)
                    f.flush()
                    grown, pss_now = monitor.held(), monitor.pss()
                finally:
                    os.unlink(f.name)
        assert grown is not None and pss_now is not None
        seen.append((grown - held, pss_now - pss))
        # held: the pages; PSS: nobody maps them
        if grown - held > 0.9 * size and pss_now - pss < 0.1 * size:
            return
    pytest.fail(f"(held, PSS) growth in bytes for a {size}-byte file no process maps: {seen}")


def test_the_monitor_keeps_its_first_reading_as_the_tree_before_the_loader():
    # the budget row's ram_budget is its share of the tree less this reading (bench/run.py)
    with TreeMonitor() as monitor:
        before = monitor.start_held
        block = bytearray(64 * 2**20)  # the "loader": 64 MB of this process's own pages
        monitor.sample_held()
        assert monitor.start_held == before  # the first reading stays
    assert before is not None and monitor.peak_held is not None
    assert monitor.peak_held - before > 0.9 * len(block)


def test_the_monitor_says_what_each_process_held_at_the_peak():
    # where a row's peak came from: this process's own pages, apart from shared memory
    with TreeMonitor() as monitor:
        block = bytearray(64 * 2**20)
        block[::4096] = b"\1" * (len(block) // 4096)
        monitor.sample_held()
        parts = dict(monitor.peak_parts)
    del block
    mine = str(os.getpid())
    assert parts[mine] >= 64 and parts[f"{mine} private"] >= 64, parts
    assert "shmem" in parts


def test_the_index_and_its_shared_copy_give_the_same_samples():
    index, shared = cow.Index(50), cow.SharedIndex(50)
    assert len(index) == len(shared) == 50
    for i in (0, 7, 49):
        (a, label_a), (b, label_b) = index[i], shared[i]
        assert label_a == label_b == i and a.equal(b)


def test_rows_report_growth_speed_and_verdicts_against_torch(tmp_path, capsys):
    out = tmp_path / "cow.json"
    cow.main(["--items", "20000", "--epochs", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["results"]) == set(cow.configurations())
    for row in report["results"].values():
        assert row["samples_per_s"] > 0 and row["growth_mb"] is not None
    # torch's growth may be ~0 on so small an index
    assert set(report["targets"]) <= set(cow.TARGETS)
    printed = capsys.readouterr().out
    assert "| torchpipe_dataloader_shared |" in printed and "samples/s" in printed
    with pytest.raises(SystemExit):
        cow.main(["--repeat", "0"])


def test_a_verdict_holds_growth_to_its_share_and_the_shared_index_to_torch_s_speed():
    results = {
        "dataloader": {"growth_mb": 1000.0, "samples_per_s": 100.0, "workers": 4},
        "torchpipe_dataloader": {"growth_mb": 990.0, "samples_per_s": 50.0, "workers": 4},
        "torchpipe_dataloader_shared": {"growth_mb": 150.0, "samples_per_s": 90.0, "workers": 4},
    }
    verdicts = cow.verdicts(results)
    assert verdicts["torchpipe_dataloader"]["met"]  # no speed target on the list-holding row
    assert not verdicts["torchpipe_dataloader_shared"][
        "met"
    ]  # 0.15x the growth, but 0.9x the speed
    assert verdicts["torchpipe_dataloader_shared"]["growth_vs_torch"] == 0.15


def test_the_soak_reads_pss_after_every_epoch_of_each_loader(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "soak.json"
    soak.main(["--epochs", "3", "--workers", "1", "--files", "16", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report["loaders"]) == {
        "dataloader",
        "torchpipe_dataloader",
        "torchpipe_dataloader_auto",
    }
    for entry in report["loaders"].values():
        assert (
            len(entry["pss_mb"]) == 3
            and min(entry["pss_mb"]) > 0
            and isinstance(entry["met"], bool)
        )
    assert "epoch 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        soak.main(["--epochs", "1"])

import json
import os
import time
from collections import Counter, defaultdict

import pytest
import torch

import torchpipe as tp
from torchpipe.observe.chrome_trace import pack_lanes

PHASES = {"X", "C", "M", "i"}


def check_chrome_trace(data):
    """Check ``data`` against the Trace Event Format: the fields each phase needs, and complete
    events that nest on every thread (Perfetto drops or misdraws the ones that do not)."""
    assert set(data) >= {"traceEvents"} and isinstance(data["traceEvents"], list)
    by_thread = defaultdict(list)
    for event in data["traceEvents"]:
        assert event["ph"] in PHASES and isinstance(event["name"], str) and event["name"], event
        assert isinstance(event["pid"], int), event
        if event["ph"] == "M":
            assert event["name"] in (
                "thread_name",
                "process_name",
                "thread_sort_index",
                "process_sort_index",
            )
            assert isinstance(event["tid"], int) and event["args"]
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["tid"], int) and event["dur"] >= 0, event
            # in whole nanoseconds, as Perfetto reads them
            by_thread[event["pid"], event["tid"]].append(
                (round(event["ts"] * 1000), round((event["ts"] + event["dur"]) * 1000))
            )
        elif event["ph"] == "C":
            assert (
                all(isinstance(v, (int, float)) for v in event["args"].values()) and event["args"]
            ), event
        else:
            assert event["s"] in ("t", "p", "g") and isinstance(event["tid"], int), event
    for spans in by_thread.values():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert b0 >= a1 or b1 <= a1, f"spans {a0}-{a1} and {b0}-{b1} overlap without nesting"


def decode(i):
    time.sleep(0.001)
    return torch.full((8,), float(i))


def _threads(data):
    return {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}


def _spans_on(data, thread):
    tids = {
        (e["pid"], e["tid"])
        for e in data["traceEvents"]
        if e["name"] == "thread_name" and e["args"]["name"] == thread
    }
    return [e for e in data["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) in tids]


def test_a_traced_pipeline_on_worker_processes(tmp_path):
    ds = (
        tp.range(96)
        .map(decode, num_parallel_calls=2, executor="process")
        .batch(8)
        .prefetch(2)
        .with_options(tp.Options(trace=True))
    )
    with iter(ds) as it:
        for _ in it:
            time.sleep(0.002)
        it.trace(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    check_chrome_trace(data)
    threads = _threads(data)
    assert {"training loop", "prefetch", "map(decode)+batch", "batch", "range"} <= threads
    workers = [t for t in threads if t.startswith("map(decode)+batch on worker")]
    assert len(workers) == 2
    processes = {
        e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"
    }
    for worker in workers:  # each in its own process, named after the stage
        pid = int(worker.split("pid ")[1].rstrip(")"))
        assert processes[pid] == f"map(decode)+batch worker (pid {pid})"
        assert {e["pid"] for e in _spans_on(data, worker)} == {pid}
    calls = sum(len(_spans_on(data, w)) for w in workers)
    assert calls == 12  # 96 elements in batches of 8, a call a batch
    waits = _spans_on(data, "training loop")
    assert Counter(e["name"] for e in waits) == {"waiting for data": 12, "training step": 11}
    counters = {e["name"] for e in data["traceEvents"] if e["ph"] == "C"}
    assert {"prefetch buffer", "map(decode)+batch buffer"} <= counters
    for e in _spans_on(data, workers[0]):
        assert 8_000 <= e["dur"] < 1_000_000  # 8 calls of 1 ms, in microseconds


def test_every_expensive_element_is_recorded_and_all_with_trace_all(tmp_path):
    slow = (
        tp.range(30)
        .map(decode)
        .with_options(tp.Options(trace=True, optimizations={"inject_prefetch": False}))
    )
    with iter(slow) as it:
        list(it)
        it.trace(tmp_path / "a.json")
    data = json.loads((tmp_path / "a.json").read_text())
    assert len(_spans_on(data, "map(decode)")) == 30  # each costs 1 ms: all clocked
    cheap = tp.range(2000).map(lambda x: x + 1)
    for detail, check in ((True, lambda n: 0 < n < 1000), ("all", lambda n: n == 2000)):
        with iter(
            cheap.with_options(tp.Options(trace=detail, optimizations={"inject_prefetch": False}))
        ) as it:
            list(it)
            it.trace(tmp_path / "b.json")
        data = json.loads((tmp_path / "b.json").read_text())
        check_chrome_trace(data)
        assert check(len(_spans_on(data, "range"))), (detail, len(_spans_on(data, "range")))
        assert data["otherData"]["torchpipe_detail"] == (
            "every element" if detail == "all" else "elements the stats clock"
        )


def test_thread_calls_and_autotune_knobs(tmp_path):
    ds = (
        tp.range(200)
        .map(decode, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .prefetch(tp.AUTOTUNE)
        .with_options(tp.Options(trace=True))
    )
    with iter(ds) as it:
        list(it)
        it.trace(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    check_chrome_trace(data)
    on_threads = [t for t in _threads(data) if t.startswith("map(decode) on thread ")]
    assert on_threads and sum(len(_spans_on(data, t)) for t in on_threads) == 200
    knobs = [
        e for e in data["traceEvents"] if e["ph"] == "C" and e["name"] == "map(decode).parallelism"
    ]
    assert knobs and knobs[0]["ts"] < 1e6  # its value when the pass started, then each change


def test_untraced_passes_record_nothing_and_say_how_to_trace(tmp_path):
    with iter(tp.range(5).map(decode, num_parallel_calls=2)) as it:
        list(it)
        assert it.stats().trace is None
        with pytest.raises(
            RuntimeError,
            match=r"not traced: run it with ds.with_options\(tp.Options\(trace=True\)\)",
        ):
            it.trace(tmp_path / "t.json")
        with pytest.raises(RuntimeError, match="not traced"):
            it.stats().plot(tmp_path / "t.png")
    assert not (tmp_path / "t.json").exists()


def test_options_trace_is_checked():
    with pytest.raises(ValueError, match="Options.trace must be False, True or 'all', got 'some'"):
        tp.Options(trace="some")
    with pytest.raises(TypeError, match="Options.trace must be False, True or 'all', got 1"):
        tp.Options(trace=1)


def test_overlapping_spans_go_to_lanes():
    assert pack_lanes([(0, 5), (1, 2), (3, 9), (5, 6), (9, 10)]) == [
        [(0, 5), (5, 6), (9, 10)],
        [(1, 2), (3, 9)],
    ]


def test_interleaved_readers_share_a_track_in_lanes(tmp_path):
    ds = (
        tp.range(4)
        .interleave(
            lambda i: tp.range(5).map(decode).batch(1),
            cycle_length=4,
            num_parallel_calls=4,
            executor="thread",
        )
        .with_options(tp.Options(trace=True))
    )
    with iter(ds) as it:
        assert len(list(it)) == 20
        it.trace(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    check_chrome_trace(data)
    lanes = [
        t for t in _threads(data) if t.startswith("map(decode)")
    ]  # the 4 readers' maps: one track
    assert len(lanes) >= 2 and sum(len(_spans_on(data, t)) for t in lanes) == 20
    reads = [t for t in _threads(data) if t.startswith("interleave(<lambda>) on thread ")]
    # a span for each lot a reader hands over (up to 16 reads): at least one a reader
    assert sum(len(_spans_on(data, t)) for t in reads) >= 4


def test_the_trace_shown_in_the_docs_is_valid():
    with open(
        os.path.join(os.path.dirname(__file__), "..", "..", "docs", "img", "trace.json")
    ) as f:
        data = json.load(f)
    check_chrome_trace(data)
    threads = _threads(data)
    assert {"training loop", "prefetch", "map(JpegSample)+batch"} <= threads
    assert [t for t in threads if t.startswith("map(JpegSample)+batch on worker")]

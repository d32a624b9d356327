"""A traced pass as a timeline PNG: the plot, merged spans, and the missing-matplotlib error."""

import sys

import pytest

import torchpipe as tp
from tests.observe.test_chrome_trace import decode
from torchpipe.observe.timeline import merge_spans


def test_the_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    ds = (
        tp.range(64)
        .map(decode, num_parallel_calls=2, executor="thread")
        .batch(8)
        .with_options(tp.Options(trace=True))
    )
    with iter(ds) as it:
        list(it)
        it.stats().plot(tmp_path / "t.png")
    data = (tmp_path / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_plot_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with iter(tp.range(3).with_options(tp.Options(trace=True))) as it:
        list(it)
        with pytest.raises(ImportError, match=r"pip install 'torchpipe\[plot\]'"):
            it.stats().plot(tmp_path / "t.png")


def test_spans_closer_than_the_gap_are_joined_in_order():
    spans = [(5.0, 6.0), (0.0, 1.0), (1.05, 2.0), (1.5, 1.8), (3.0, 4.0)]
    assert merge_spans(spans, 0.1) == [(0.0, 2.0), (3.0, 4.0), (5.0, 6.0)]
    # a span inside another joins it whatever the gap
    assert merge_spans(spans, 0.0) == [(0.0, 1.0), (1.05, 2.0), (3.0, 4.0), (5.0, 6.0)]
    assert merge_spans([], 1.0) == []

"""The counters every iterator keeps (torchpipe/core/stats.py)."""

import random
import time

import pytest

import torchpipe as tp
from torchpipe.core import stats as stats_module
from torchpipe.core.stats import CLOCK_ALL_S, CLOCK_EVERY, IteratorStats


def feed(stats, seconds):
    """Drive ``stats`` as Iterator.__next__ does: only the elements it asks to clock are timed."""
    for s in seconds:
        if stats.unclocked:
            stats.unclocked -= 1
        else:
            stats.clocked(s)
        stats.produced += 1


def test_slow_elements_are_all_clocked():
    stats = IteratorStats()
    times = [CLOCK_ALL_S * (1 + i % 3) for i in range(100)]
    feed(stats, times)
    assert stats.produced == 100 and stats.wall_s == pytest.approx(sum(times))


def test_cheap_elements_are_sampled_and_the_estimate_is_right():
    stats = IteratorStats()
    clocks = []
    original = stats.clocked
    stats_clocked = lambda s: (clocks.append(s), original(s))  # noqa: E731
    for _ in range(CLOCK_EVERY * 1000):
        if stats.unclocked:
            stats.unclocked -= 1
        else:
            stats_clocked(1e-6)
        stats.produced += 1
    assert 500 < len(clocks) < 2000  # about one in CLOCK_EVERY
    assert stats.wall_s == pytest.approx(1e-6 * CLOCK_EVERY * 1000, rel=0.15)


@pytest.mark.parametrize("period", [4, CLOCK_EVERY])
def test_costs_that_repeat_are_estimated_without_bias(period, monkeypatch):
    # One element in `period` is slow (a read every few records): sampling must not fall in step.
    # The gaps are random: seeded here, so the estimate's spread (about 6% of runs miss by more
    # than 10%) cannot make the test flaky, whatever ran before.
    monkeypatch.setattr(stats_module, "CLOCK_GAPS", random.Random(7))
    stats = IteratorStats()
    times = [100e-6 if i % period == 0 else 2e-6 for i in range(40_000)]
    feed(stats, times)
    assert stats.wall_s == pytest.approx(sum(times), rel=0.1)


def test_waits_count_once_however_the_element_was_weighted():
    """A cheap element clocked with weight CLOCK_EVERY that waited 5 ms adds 5 ms, not 80."""
    stats = IteratorStats()
    stats.clocked(1e-6)  # cheap: the next clocked element stands for CLOCK_EVERY
    stats.unclocked = 0
    stats.wait_s += 5e-3  # counted as it happened, inside the element
    stats.clocked(5e-3 + 1e-6, waited=5e-3)
    assert stats.wall_s == pytest.approx(1e-6 + 5e-3 + CLOCK_EVERY * 1e-6)
    # the op's own time
    assert stats.wall_s - stats.wait_s == pytest.approx((1 + CLOCK_EVERY) * 1e-6)


def test_iterators_count_every_element_and_time_slow_ones():
    def slow(x):
        time.sleep(0.001)
        return x

    it = iter(
        tp.range(50).map(slow).with_options(tp.Options(optimizations={"inject_prefetch": False}))
    )
    assert list(it) == list(range(50))
    stage = it.stats()[0]
    assert stage["produced"] == 50 and 0.05 <= stage["self_s"] * 50 < 5

"""The stall watchdog: the oldest work out too long raises, naming the stage, the work and where it runs."""

import pytest

import torchpipe as tp
from torchpipe.runtime import stall
from torchpipe.runtime.stall import StallWatch


class _Clock:
    """The stall module's clock in a test: time passes only when the test moves it on."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(stall, "time", fake)
    return fake


def test_work_out_too_long_raises_naming_the_stage_the_work_and_where(clock):
    watch = StallWatch("interleave(read)", 1.0, label="a read of inner dataset")
    watch.begin(3, "thread interleave(read)-0")
    watch.check()  # not yet
    clock.now += 2.0
    named = r"interleave\(read\): a read of inner dataset 3 .* thread interleave\(read\)-0"
    with pytest.raises(tp.StallError, match=named) as info:
        watch.check()
    assert (info.value.stage, info.value.seq, info.value.where) == (
        "interleave(read)",
        3,
        "thread interleave(read)-0",
    )


def test_where_is_asked_for_work_begun_without_saying(clock):
    watch = StallWatch("map(f)", 0.5)
    watch.begin(7)
    clock.now += 1.0
    with pytest.raises(tp.StallError, match=r"element 7 .* worker process 42"):
        watch.check(lambda seq: f"worker process {seq * 6}")


def test_work_begun_again_is_young_again_and_done_work_is_not_watched(clock):
    watch = StallWatch("s", 1.0)
    watch.begin(1)
    watch.begin(2)
    clock.now += 2.0
    watch.begin(1)  # a reader's next read
    assert watch.seqs() == [2, 1]
    assert watch.end(2) and not watch.end(2)
    watch.check()  # 1 began again just now
    watch.clear()
    assert watch.seqs() == []


def test_no_limit_never_raises(clock):
    watch = StallWatch("s", None)
    watch.begin(1)
    clock.now += 10**6
    watch.check()


def test_work_that_waited_for_other_work_is_clocked_from_when_it_starts_its_own(clock):
    """A process interleave's chunk that waited in its worker for the chunk before it."""
    watch = StallWatch("interleave(read)", 1.0)
    watch.begin(1, "worker 0")
    watch.begin(2, "worker 0")
    clock.now += 0.8
    watch.end(1)
    watch.again(2)  # the chunk before it came back: its own read starts about now
    watch.again(7)  # work not out stays not out
    clock.now += 0.8
    watch.check()  # 1.6 s out, 0.8 s of its own
    assert watch.seqs() == [2]
    clock.now += 0.3
    with pytest.raises(tp.StallError, match="worker 0"):
        watch.check()

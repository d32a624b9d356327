"""The autotuner's view of a stage: Tunable's defaults, and WeakStage answering for its owner."""

import gc

import pytest

from torchpipe.core.stats import IteratorStats
from torchpipe.core.tunable import BUFFER, POOL, Tunable, WeakStage, weakly


class Owner:
    """What a WeakStage answers for: a pool of three processes."""

    def children(self):
        return ["input"]

    def knobs(self):
        return ["workers"]

    def buffer_slots(self):
        return 6

    def parallelism(self):
        return 3

    def calls_in_processes(self):
        return True

    def executor_report(self):
        return {"executor": "process"}


def _answers(stage):
    return (
        stage.children(),
        stage.knobs(),
        stage.buffer_slots(),
        stage.parallelism(),
        stage.calls_in_processes(),
        stage.calls_on_cluster(),
        stage.executor_report(),
    )


def test_a_tunable_must_answer_the_contract_and_may_keep_the_defaults():
    class Partial(Tunable):
        def children(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    stage = WeakStage("s", BUFFER, Owner())  # a Tunable that overrides neither default
    assert not stage.calls_on_cluster() and Tunable.executor_report(stage) == {}


def test_a_weak_stage_answers_for_its_owner_while_it_lives():
    owner = Owner()
    stage = WeakStage("map(f)", POOL, owner)
    assert (stage.name, stage.tuning_role) == ("map(f)", POOL)
    assert isinstance(stage.stats, IteratorStats)
    assert _answers(stage) == (["input"], ["workers"], 6, 3, True, False, {"executor": "process"})


def test_a_weak_stage_does_not_keep_its_owner_alive_and_then_answers_nothing():
    owner = Owner()
    stage = WeakStage("map(f)", POOL, owner)
    stats = stage.stats
    del owner
    gc.collect()
    assert _answers(stage) == ([], [], 0, 0, False, False, {})
    assert stage.stats is stats  # the stage's counters stay the stage's


def test_a_weak_call_reaches_its_object_while_it_lives_and_does_nothing_after():
    class Sized:
        def __init__(self):
            self.sizes = []

        def resize(self, n):
            self.sizes.append(n)

    sized = Sized()
    call = weakly(sized.resize)
    call(3)
    assert sized.sizes == [3]
    seen = sized.sizes
    del sized
    gc.collect()
    call(4)  # its object is gone: nothing to call, nothing kept alive
    assert seen == [3]

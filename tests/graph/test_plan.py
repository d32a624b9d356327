"""PipelineIterator: checkpoint format, seeds, close, stats."""

import gc
import pickle

import pytest
import torch

import torchpipe as tp
from torchpipe.errors import CheckpointError


def test_state_dict_is_small_picklable_and_torch_saveable(tmp_path):
    ds = tp.range(100).map(lambda x: x * 2).filter(lambda x: x % 3 == 0)
    it = iter(ds)
    [next(it) for _ in range(5)]
    state = it.state_dict()
    assert set(state) == {"format", "ops", "seed", "epoch", "pipeline"}
    assert len(pickle.dumps(state)) < 1000
    torch.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed = iter(ds)
    resumed.load_state_dict(loaded)
    assert next(resumed) == next(it)


def test_state_from_another_pipeline_is_rejected():
    state = iter(tp.range(5).map(abs)).state_dict()
    with pytest.raises(CheckpointError, match="another pipeline"):
        iter(tp.range(5).filter(bool)).load_state_dict(state)
    with pytest.raises(CheckpointError, match="format"):
        iter(tp.range(5)).load_state_dict({"pipeline": {}})
    with pytest.raises(CheckpointError):
        iter(tp.range(5)).load_state_dict({**iter(tp.range(5)).state_dict(), "pipeline": {}})
    assert issubclass(CheckpointError, ValueError)


def test_unseeded_pipelines_differ_but_resume_exactly():
    ds = tp.range(6).map(lambda x: float(tp.rng().random()))
    a, b = list(ds), list(ds)
    assert a != b
    it = iter(ds)
    head = [next(it) for _ in range(2)]
    state = it.state_dict()
    rest = list(it)
    resumed = iter(ds)
    resumed.load_state_dict(state)
    assert list(resumed) == rest and len(head + rest) == 6


def test_load_state_dict_can_rewind_a_running_iterator():
    it = iter(tp.range(5))
    start = it.state_dict()
    assert list(it) == [0, 1, 2, 3, 4]
    it.load_state_dict(start)
    assert list(it) == [0, 1, 2, 3, 4]


def test_close_and_context_manager_and_stats():
    ds = tp.range(10).map(lambda x: x, num_parallel_calls=2)
    with iter(ds) as it:
        next(it)
        stages = [s["stage"] for s in it.stats()]
        assert stages == ["map(<lambda>)", "range"]
    assert it.stats() == []
    assert iter(ds).stats() == []


def test_abandoned_iterators_are_collected():
    import weakref

    it = iter(tp.range(100).map(lambda x: x, num_parallel_calls=2))
    next(it)
    ref = weakref.ref(it)
    del it
    gc.collect()
    assert ref() is None


def test_a_resumed_dataset_goes_on_with_the_epoch_after_the_checkpoint():
    def make():
        return tp.range(20).shuffle(20, seed=1)

    ds = make()
    list(ds), list(ds)
    it = iter(ds)  # epoch 2
    [next(it) for _ in range(5)]
    state = it.state_dict()
    rest, epoch3 = list(it), list(ds)
    assert sorted(epoch3) == list(range(20)) and epoch3 != sorted(epoch3)

    ds2 = make()  # as in a fresh process
    resumed = iter(ds2)
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    assert list(iter(ds2)) == epoch3
    assert iter(ds2).state_dict()["epoch"] == 4

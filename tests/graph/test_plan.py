"""PipelineIterator: checkpoint format, seeds, close, stats."""

import copy
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


def _state_after(ds, count):
    it = iter(ds)
    [next(it) for _ in range(count)]
    return it.state_dict()


class Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize(
    "before, after, says",
    [
        (
            tp.range(40).batch(4),
            tp.range(40).batch(8),
            ["op 0 was batch(batch_size=4", "batch(batch_size=8"],
        ),
        (tp.range(40).batch(4), tp.range(20).batch(4), ["stop=40", "stop=20"]),
        (tp.from_dataset(Items(40)), tp.from_dataset(Items(20)), ["len=40", "len=20"]),
        (tp.range(40).shuffle(8, seed=1), tp.range(40).shuffle(8, seed=2), ["seed=1", "seed=2"]),
        (tp.range(40).map(abs), tp.range(40).map(float), ["fn=abs", "fn=float"]),
    ],
)
def test_a_state_only_loads_into_a_pipeline_with_the_same_parameters(before, after, says):
    state = _state_after(before, 3)
    with pytest.raises(CheckpointError, match="other parameters") as info:
        iter(after).load_state_dict(state)
    assert all(text in str(info.value) for text in says)


def test_a_state_loads_where_only_speed_or_the_function_object_changed():
    state = _state_after(
        tp.range(40).map(lambda x: x * 2, num_parallel_calls=2).batch(4).prefetch(2), 3
    )
    # a new process re-creates the lambda; the parallelism and the prefetch depth do not change elements
    resumed = iter(
        tp.range(40)
        .map(lambda x: x * 2, num_parallel_calls=3, executor="thread")
        .batch(4)
        .prefetch(5)
    )
    resumed.load_state_dict(state)
    assert next(resumed).tolist() == [24, 26, 28, 30]
    resumed.close()


def test_a_state_of_an_older_format_is_refused_clearly():
    state = _state_after(tp.range(10), 2)
    old = {**state, "format": 2, "ops": ["range", "->", "range"]}
    with pytest.raises(CheckpointError, match="format 2, from an older torchpipe"):
        iter(tp.range(10)).load_state_dict(old)


@pytest.mark.parametrize(
    "garble, says",
    [
        (
            lambda s: s["pipeline"]["input"].update(index="5"),
            r"range: state\['index'\] must be an int, got str '5'",
        ),
        (
            lambda s: s["pipeline"]["input"].update(index=-3),
            r"range: state\['index'\] is -3, outside \[0, 10\]",
        ),
        (
            lambda s: s["pipeline"]["input"].update(index=99),
            r"range: state\['index'\] is 99, outside \[0, 10\]",
        ),
        (lambda s: s["pipeline"]["input"].pop("index"), r"range: state is missing \['index'\]"),
        (lambda s: s["pipeline"].update(seq=1.5), r"map\(abs\): state\['seq'\] must be an int"),
        (lambda s: s["pipeline"].update(input=[1]), r"range: expected a state dict, got list"),
        (lambda s: s.update(seed="12"), r"pipeline: state\['seed'\] must be an int"),
        (lambda s: s.update(epoch=None), r"pipeline: state\['epoch'\] must be an int"),
        (lambda s: s.pop("pipeline"), r"pipeline: state is missing \['pipeline'\]"),
        (lambda s: s.update(ops="range"), r"'ops' is malformed"),
    ],
)
def test_malformed_values_are_checkpoint_errors_naming_the_stage_and_the_key(garble, says):
    ds = tp.range(10).map(abs).with_options(tp.Options(optimizations={"inject_prefetch": False}))
    state = _state_after(ds, 2)
    garble(state)
    with pytest.raises(CheckpointError, match=says):
        iter(ds).load_state_dict(state)


def test_garbled_counters_and_flags_of_every_kind_of_op_are_checkpoint_errors():
    ds = (
        tp.range(30)
        .take(20)
        .repeat(2)
        .shuffle(4, seed=0)
        .batch(2)
        .with_options(
            tp.Options(optimizations={"inject_prefetch": False, "shuffle_repeat_fusion": False})
        )
    )
    state = _state_after(ds, 3)
    shuffle = state["pipeline"]["input"]
    for garble in (
        lambda s: s.update(input_done="no"),
        lambda s: s["input"].update(fresh=0),
        lambda s: s["input"].update(repetition="1"),
        lambda s: s["input"]["input"].update(taken=[3]),
    ):
        broken = copy.deepcopy(state)
        garble(broken["pipeline"]["input"])
        with pytest.raises(
            CheckpointError, match=r"state\['(input_done|fresh|repetition|taken)'\] must be"
        ):
            iter(ds).load_state_dict(broken)
    assert shuffle["input_done"] is False


def test_checkpoint_error_is_public():
    assert tp.CheckpointError is CheckpointError and "CheckpointError" in tp.__all__
    assert tp.__all__ == sorted(tp.__all__)


def test_the_tree_is_what_the_first_element_built_until_close():
    """PipelineIterator.tree, the seam of testing.stages: the running op iterators' root."""
    it = iter(
        tp.range(4).map(abs).with_options(tp.Options(optimizations={"inject_prefetch": False}))
    )
    assert it.tree is None
    assert next(it) == 0
    root = it.tree
    assert root is not None and root.name.startswith("map")
    it.close()
    assert it.tree is None


def test_a_pass_sizes_the_heap_kept_between_elements_at_its_first(monkeypatch):
    from torchpipe.graph import plan

    asked = []
    monkeypatch.setattr(plan, "hold_free", asked.append)
    ds = tp.range(40).map(lambda i: {"payload": bytes(1000), "i": i}).batch(8)
    for _ in range(2):
        assert len(list(ds)) == 5
    assert asked == [8 * 1000 + 8 * 8] * 2  # the first batch of each pass

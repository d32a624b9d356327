"""window: tf.data's windows, as tuples of elements."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import torchpipe as tp
from torchpipe.errors import CheckpointError
from torchpipe.testing import assert_checkpoint_roundtrip, assert_elements_equal


def reference(n, size, shift, stride, drop_remainder):
    """Windows of range(n) from the definition: window i holds i * shift + j * stride, j < size."""
    windows = []
    for start in range(0, n, shift):
        window = tuple(x for x in range(start, start + size * stride, stride) if x < n)
        if len(window) == size or not drop_remainder:
            windows.append(window)
    return windows


# -- what it yields ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, expected",
    [
        ((3,), [(0, 1, 2), (3, 4, 5), (6,)]),  # tf.data's documented examples
        ((3, 2, 1, True), [(0, 1, 2), (2, 3, 4), (4, 5, 6)]),
        ((3, 1, 2, True), [(0, 2, 4), (1, 3, 5), (2, 4, 6)]),
        (
            (3, 1),
            [(0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 4, 5), (4, 5, 6), (5, 6), (6,)],
        ),  # cut short at the end
        ((3, 2, 2), [(0, 2, 4), (2, 4, 6), (4, 6), (6,)]),
        ((2, 3), [(0, 1), (3, 4), (6,)]),  # shift > size: elements between windows are left out
        ((2, 3, 1, True), [(0, 1), (3, 4)]),
        ((1, 1), [(0,), (1,), (2,), (3,), (4,), (5,), (6,)]),
        ((8,), [(0, 1, 2, 3, 4, 5, 6)]),
        ((8, 1, 1, True), []),
    ],
)
def test_tf_data_examples(args, expected):
    assert list(tp.range(7).window(*args)) == expected


def test_matches_the_definition_and_the_cardinality_for_many_parameters():
    for n in (0, 1, 5, 7, 12):
        for size, shift, stride in [
            (1, 1, 1),
            (2, 1, 1),
            (3, 2, 1),
            (3, 1, 2),
            (2, 5, 1),
            (4, 3, 3),
            (3, 7, 2),
        ]:
            for drop in (False, True):
                ds = tp.range(n).window(size, shift, stride, drop)
                expected = reference(n, size, shift, stride, drop)
                assert list(ds) == expected, (n, size, shift, stride, drop)
                assert ds.cardinality() == len(expected), (n, size, shift, stride, drop)


def test_shift_defaults_to_size():
    assert (
        tp.range(7)
        .window(2)
        .explain()
        .count("window(size=2, shift=2, stride=1, drop_remainder=False)")
        >= 1
    )
    assert list(tp.range(5).window(2)) == [(0, 1), (2, 3), (4,)]


def test_empty_input_yields_no_window():
    assert list(tp.range(0).window(3)) == []
    assert list(tp.range(0).window(3, 1, 2, drop_remainder=True)) == []
    assert tp.range(0).window(3).cardinality() == 0


def test_windows_hold_the_elements_as_they_are():
    ds = tp.range(4).map(lambda i: ({"x": torch.full((2,), i)}, str(i))).window(2, 1)
    windows = list(ds)
    assert len(windows) == 4 and all(isinstance(w, tuple) for w in windows)
    assert_elements_equal(
        windows[0], (({"x": torch.tensor([0, 0])}, "0"), ({"x": torch.tensor([1, 1])}, "1"))
    )
    assert_elements_equal(windows[-1], (({"x": torch.tensor([3, 3])}, "3"),))


def test_map_unpacks_a_window_and_batch_collates_it():
    frames = tp.range(6).map(lambda i: torch.full((2,), i)).window(3, 1, drop_remainder=True)
    stacked = [w.tolist() for w in frames.map(lambda *w: torch.stack(w))]
    assert stacked == [[[i, i], [i + 1, i + 1], [i + 2, i + 2]] for i in range(4)]
    first = next(iter(tp.range(6).window(2, drop_remainder=True).batch(3)))
    assert [t.tolist() for t in first] == [
        [0, 2, 4],
        [1, 3, 5],
    ]  # windows batch as tuples do: position by position


def test_infinite_input_streams_through_with_take():
    ds = tp.range(3).repeat().window(2, 4)
    assert ds.cardinality() == tp.INFINITE
    assert list(ds.take(4)) == [(0, 1), (1, 2), (2, 0), (0, 1)]
    assert ds.take(4).cardinality() == 4


def test_unknown_cardinality_stays_unknown():
    assert tp.range(7).filter(lambda x: x % 2 == 0).window(2).cardinality() == tp.UNKNOWN


def test_elements_between_windows_are_skipped_without_reading_a_seekable_source():
    class Counted(torch.utils.data.Dataset):
        def __init__(self):
            self.read = []

        def __len__(self):
            return 12

        def __getitem__(self, i):
            self.read.append(i)
            return i

    data = Counted()
    assert list(tp.from_dataset(data).window(2, 5)) == [(0, 1), (5, 6), (10, 11)]
    assert sorted(data.read) == [0, 1, 5, 6, 10, 11]


def test_an_error_of_an_element_no_window_holds_is_dropped_and_others_reach_the_caller():
    def boom(x):
        if x in (2, 7):
            raise KeyError(f"bad {x}")
        return x

    assert list(tp.range(10).map(boom).window(2, 5)) == [
        (0, 1),
        (5, 6),
    ]  # 2 and 7 lie between windows
    it = iter(tp.range(10).map(boom).window(3))
    with pytest.raises(KeyError, match="bad 2"):
        next(it)
    assert next(it) == (0, 1, 3)  # the windows go on with the elements after the one that raised


def test_stats_count_windows_and_the_elements_read():
    it = iter(tp.range(10).window(3))
    assert len(list(it)) == 4
    produced = {stage["stage"]: stage["produced"] for stage in it.stats()}
    assert produced["window"] == 4 and produced["range"] == 10


# -- checkpoints ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.range(11).window(3),
        lambda: tp.range(11).window(3, 1),
        lambda: tp.range(11).window(3, 2, 2, drop_remainder=True),
        lambda: tp.range(11).window(2, 4),  # a state between windows holds input elements to skip
        lambda: tp.range(4).repeat().window(3, 5, 1).take(6),
        lambda: tp.range(12).shuffle(4, seed=0).window(3, 1).map(lambda *w: torch.tensor(w)),
        lambda: (
            tp.range(8)
            .map(lambda i: {"x": torch.full((i % 3 + 1,), i)})
            .window(2, 1)
            .batch(2, collate_fn=list)
        ),
    ],
)
def test_checkpoint_roundtrip(make):
    assert assert_checkpoint_roundtrip(make(), max_elements=40)


def _state_after(ds, taken):
    it = iter(ds)
    for _ in range(taken):
        next(it)
    return pickle.loads(pickle.dumps(it.state_dict()))


def _pairs():
    return tp.range(10).map(lambda i: (torch.full((2,), i), i)).window(3, 1)


def test_the_state_holds_the_elements_of_the_windows_in_progress():
    ds = tp.range(10).window(4, 1)
    state = _state_after(ds, 3)
    assert state["pipeline"]["buffer"] == [3, 4, 5]
    it = iter(ds)
    it.load_state_dict(state)
    assert list(it) == reference(10, 4, 1, 1, False)[3:]


@pytest.mark.parametrize(
    "garble, message",
    [
        (
            lambda s: s["buffer"].__setitem__(1, "x"),
            r"state\['buffer'\] element 1 is str, but the op held tuple",
        ),
        (
            lambda s: s["buffer"].extend(s["buffer"]),
            r"state\['buffer'\] must be a list of at most 3 elements",
        ),
        (lambda s: s.__setitem__("buffer", "abc"), r"state\['buffer'\] must be a list"),
        (lambda s: s.__setitem__("skip", -1), r"state\['skip'\] is -1"),
        (lambda s: s.__setitem__("skip", 1), r"state\['skip'\] is 1, outside \[0, 0\]"),
        (lambda s: s.__setitem__("input_done", "no"), r"state\['input_done'\] must be a bool"),
        (lambda s: s.__setitem__("structure", None), r"state\['structure'\] is None"),
        (lambda s: s.pop("skip"), r"state is missing \['skip'\]"),
    ],
)
def test_a_garbled_state_is_a_checkpoint_error(garble, message):
    ds = _pairs()
    state = _state_after(ds, 2)
    garble(state["pipeline"])
    with pytest.raises(CheckpointError, match=r"^window: " + message):
        iter(ds).load_state_dict(state)


def test_a_skip_beyond_the_gap_between_windows_is_a_checkpoint_error():
    ds = tp.range(10).window(2, 5, 1)
    state = _state_after(ds, 1)
    assert state["pipeline"]["skip"] == 3 and state["pipeline"]["buffer"] == []
    for skip, buffer, message in [
        (4, [], r"state\['skip'\] is 4, outside \[0, 3\]"),
        (3, [5], "empty while input elements are to be skipped"),
    ]:
        state["pipeline"].update(skip=skip, buffer=buffer)
        with pytest.raises(CheckpointError, match=message):
            iter(ds).load_state_dict(state)


# -- arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"size": 0}, ValueError, "size must be >= 1, got 0"),
        ({"size": 2.0}, TypeError, "size must be an int, got float"),
        ({"size": True}, TypeError, "size must be an int, got bool"),
        ({"size": 2, "shift": 0}, ValueError, "shift must be >= 1, got 0"),
        ({"size": 2, "shift": "1"}, TypeError, "shift must be an int, got str"),
        ({"size": 2, "stride": -1}, ValueError, "stride must be >= 1, got -1"),
        ({"size": 2, "stride": None}, TypeError, "stride must be an int, got NoneType"),
        ({"size": 2, "drop_remainder": 1}, TypeError, "drop_remainder must be a bool, got int"),
    ],
)
def test_arguments_are_checked_at_the_call(kwargs, error, message):
    with pytest.raises(error, match="^window: " + message):
        tp.range(3).window(**kwargs)


# -- distribution -----------------------------------------------------------------------------
def _on_rank(ds, rank, **kwargs):
    return ds.with_options(
        tp.Options(seed=0, distribute=tp.DistributeOptions(rank=rank, world_size=2, **kwargs))
    )


def test_on_two_ranks_each_windows_its_own_share_of_the_elements():
    # the split goes below the window, where the pipeline starts: elements are split, then windowed
    shares = [list(_on_rank(tp.range(20).window(4), rank)) for rank in (0, 1)]
    assert shares[0] == [(0, 2, 4, 6), (8, 10, 12, 14), (16, 18)]
    assert shares[1] == [(1, 3, 5, 7), (9, 11, 13, 15), (17, 19)]
    assert _on_rank(tp.range(20).window(4), 0).cardinality() == 3


def test_windows_of_consecutive_elements_split_between_ranks_by_a_shard_after_the_window():
    shares = [
        list(_on_rank(tp.range(10).window(4, 1).shard(2, rank), rank, uneven="allow"))
        for rank in (0, 1)
    ]
    assert shares[0] + shares[1] == sorted(
        reference(10, 4, 1, 1, False), key=lambda w: (w[0] % 2, w[0])
    )
    assert shares[0][:2] == [(0, 1, 2, 3), (2, 3, 4, 5)]


def test_states_with_a_window_above_the_rank_split_do_not_reshard():
    # a window holds elements across its outputs: another rank could not take them over
    iterators = [iter(_on_rank(tp.range(20).window(4), rank)) for rank in (0, 1)]
    for it in iterators:
        next(it)
    with pytest.raises(
        CheckpointError, match=r"window\(size=4.* above the share node holds or makes elements"
    ):
        tp.distributed.reshard_states([it.state_dict() for it in iterators], 4)


# -- tf.data ----------------------------------------------------------------------------------
TF_PARAMS = [
    (7, 3, 2, 1, True),
    (7, 3, 1, 2, True),
    (7, 3, 3, 1, False),
    (10, 2, 5, 1, False),
    (10, 3, 1, 3, False),
    (9, 4, 2, 2, True),
    (0, 2, 1, 1, False),
    (11, 4, 3, 3, False),
]
TF_SCRIPT = """
import json, os, sys
import tensorflow as tf
out = []
for n, size, shift, stride, drop in json.loads(sys.argv[1]):
    windows = tf.data.Dataset.range(n).window(size, shift, stride, drop)
    lists = [w.tolist() for w in windows.flat_map(lambda w: w.batch(size)).as_numpy_iterator()]
    out.append({"windows": lists, "cardinality": int(windows.cardinality())})
print(json.dumps(out), flush=True)
os._exit(0)  # TensorFlow's interpreter teardown takes seconds and checks nothing here
"""


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed"
)
def test_matches_tf_data():
    """tf.data's windows for the same parameters, computed in a process of its own: TensorFlow's
    thread pools must not be inherited by the workers the suite forks later."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", TF_SCRIPT, json.dumps(TF_PARAMS)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for params, tf_result in zip(TF_PARAMS, results, strict=True):
        n, *args = params
        ds = tp.range(n).window(*args)
        assert [list(w) for w in ds] == tf_result["windows"], params
        assert ds.cardinality() == tf_result["cardinality"], params

"""``shuffle``: tf.data's buffer algorithm, its distribution, seeds, reshuffling, checkpoints."""

import collections
import itertools
import pickle

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.errors import CheckpointError
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements


def shuffled(n, buffer_size, seed):
    return list(tp.range(n).shuffle(buffer_size, seed=seed))


def test_buffer_size_one_is_the_identity():
    # verified against tf.data 2.21: range(5).shuffle(1) -> [0, 1, 2, 3, 4]
    for seed in (None, 0, 7):
        assert list(tp.range(5).shuffle(1, seed=seed)) == [0, 1, 2, 3, 4]


def test_output_is_a_permutation_and_the_seed_fixes_it():
    out = shuffled(50, 10, seed=3)
    assert sorted(out) == list(range(50)) and out != list(range(50))
    assert shuffled(50, 10, seed=3) == out
    assert shuffled(50, 10, seed=4) != out


def test_empty_and_short_inputs():
    assert list(tp.range(0).shuffle(4, seed=1)) == []
    assert sorted(tp.range(3).shuffle(100, seed=1)) == [0, 1, 2]


def test_a_full_buffer_gives_uniform_permutations():
    counts = collections.Counter(tuple(shuffled(4, 4, seed)) for seed in range(2400))
    assert len(counts) == 24  # every permutation of 4 appears
    # Each permutation has probability 1/24 (expected 100); the seeds are fixed, so this is exact
    # to reproduce, and the bounds are ~5 standard deviations wide.
    assert all(55 <= c <= 145 for c in counts.values()), counts


def test_each_element_is_equally_likely_at_each_position():
    n, runs = 6, 1200
    freq = np.zeros((n, n), dtype=int)  # freq[position, element]
    for seed in range(runs):
        for position, element in enumerate(shuffled(n, 10, seed)):
            freq[position, element] += 1
    assert np.all(np.abs(freq - runs / n) < 60), freq  # expected 200, sd ~13


def test_first_output_is_uniform_over_the_first_buffer_size_elements():
    firsts = collections.Counter(shuffled(10, 3, seed)[0] for seed in range(900))
    assert set(firsts) == {0, 1, 2}
    assert all(240 <= c <= 360 for c in firsts.values()), firsts


def test_an_element_moves_earlier_by_at_most_buffer_size_minus_one():
    n, buffer_size = 30, 4
    reached = 0
    for seed in range(200):
        for position, element in enumerate(shuffled(n, buffer_size, seed)):
            assert element - position <= buffer_size - 1
            reached = max(reached, element - position)
    assert reached == buffer_size - 1  # the bound is attained


def test_elements_keep_their_structure():
    Pair = collections.namedtuple("Pair", "x y")
    ds = tp.from_tensor_slices({"x": torch.arange(6), "y": np.arange(6) * 10}).map(
        lambda d: Pair(d["x"], d["y"])
    )
    out = list(ds.shuffle(6, seed=0))
    assert all(isinstance(e, Pair) and int(e.x) * 10 == int(e.y) for e in out)
    assert sorted(int(e.x) for e in out) == list(range(6))


def test_reshuffle_each_iteration_draws_a_new_order_every_epoch():
    ds = tp.range(20).shuffle(20, seed=5)
    first, second = list(ds), list(ds)
    assert first != second and sorted(first) == sorted(second) == list(range(20))
    # The sequence of epochs is reproducible from the seed.
    again = tp.range(20).shuffle(20, seed=5)
    assert list(again) == first and list(again) == second


def test_reshuffle_each_iteration_draws_a_new_order_every_repetition():
    out = list(tp.range(20).shuffle(20, seed=5).repeat(3))
    reps = [out[i : i + 20] for i in (0, 20, 40)]
    assert all(sorted(r) == list(range(20)) for r in reps)
    assert reps[0] != reps[1] and reps[1] != reps[2] and reps[0] != reps[2]


def test_without_reshuffle_every_epoch_and_repetition_is_the_same():
    ds = tp.range(20).shuffle(20, seed=5, reshuffle_each_iteration=False)
    first = list(ds)
    assert first != list(range(20)) and list(ds) == first
    out = list(ds.repeat(3))
    assert out == first * 3
    unseeded = tp.range(20).shuffle(20, reshuffle_each_iteration=False).repeat(2)
    out = list(unseeded)
    assert out[:20] == out[20:]


def test_pipeline_seed_makes_unseeded_shuffles_reproducible():
    def build():
        return (
            tp.range(30)
            .shuffle(8)
            .map(lambda x: x * 2)
            .shuffle(30)
            .with_options(tp.Options(seed=11))
        )

    a, b = build(), build()
    assert list(a) == list(b) and list(a) == list(b)  # epoch 0, then epoch 1
    other = (
        tp.range(30).shuffle(8).map(lambda x: x * 2).shuffle(30).with_options(tp.Options(seed=12))
    )
    assert list(other) != list(build())


def test_unseeded_pipelines_differ_between_epochs():
    ds = tp.range(30).shuffle(30, reshuffle_each_iteration=False)
    assert sorted(ds) == list(range(30))
    assert list(ds) != list(ds)  # a fresh pipeline seed each pass; equal with probability 1/30!


def test_two_shuffles_in_one_pipeline_draw_independently():
    ds = tp.zip(tp.range(20).shuffle(20), tp.range(20).shuffle(20)).with_options(tp.Options(seed=2))
    left, right = zip(*ds)
    assert left != right


def test_cardinality_is_the_inputs():
    assert tp.range(10).shuffle(3).cardinality() == 10
    assert tp.range(10).repeat().shuffle(3).cardinality() == tp.INFINITE
    assert tp.range(10).filter(lambda x: True).shuffle(3).cardinality() == tp.UNKNOWN
    assert len(tp.range(7).shuffle(100)) == 7


def test_explain_shows_the_parameters():
    text = tp.range(10).shuffle(4, seed=9, reshuffle_each_iteration=False).explain()
    assert "shuffle(buffer_size=4, seed=9, reshuffle_each_iteration=False)" in text


def test_an_infinite_input_streams_through():
    out = list(tp.range(3).repeat().shuffle(5, seed=1).take(30))
    assert len(out) == 30 and set(out) == {0, 1, 2}
    # The 30 outputs come from the first 34 inputs, so each value appears 7 to 12 times.
    assert all(7 <= c <= 12 for c in collections.Counter(out).values())


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.range(20).shuffle(5, seed=1),
        lambda: tp.range(12).shuffle(5).with_options(tp.Options(seed=3)),
        lambda: tp.range(9).shuffle(4, seed=1).repeat(2),
        lambda: tp.range(9).shuffle(4, seed=1, reshuffle_each_iteration=False).repeat(2),
        lambda: tp.range(9).repeat(2).shuffle(6, seed=2),
        lambda: tp.range(9).shuffle(3, seed=1).shuffle(4, seed=2),
        lambda: tp.range(4).repeat().shuffle(3, seed=1),
        lambda: tp.from_tensor_slices({"a": torch.arange(8), "b": np.arange(8)}).shuffle(4, seed=0),
    ],
)
def test_checkpoint_roundtrip(make):
    elements = assert_checkpoint_roundtrip(make(), max_elements=40)
    assert elements


def test_checkpoint_holds_the_buffer_and_resumes_mid_buffer():
    ds = tp.range(10).shuffle(4, seed=0)
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = pickle.loads(pickle.dumps(it.state_dict()))
    rest = list(it)
    assert len(state["pipeline"]["buffer"]) == 3  # topped up to 4 before each draw
    resumed = iter(ds)
    resumed.load_state_dict(state)
    assert_same_elements(resumed, rest)
    assert sorted(head + rest) == list(range(10))


def test_state_dict_does_not_alias_the_live_buffer():
    it = iter(tp.range(10).shuffle(5, seed=0))
    next(it)
    state = it.state_dict()
    saved = list(state["pipeline"]["buffer"])
    next(it)
    assert state["pipeline"]["buffer"] == saved


def test_a_malformed_state_is_rejected():
    ds = tp.range(10).shuffle(5, seed=0)
    state = iter(ds).state_dict()
    del state["pipeline"]["rng"]
    with pytest.raises(CheckpointError, match="shuffle"):
        iter(ds).load_state_dict(state)


def _state_mid_buffer(ds, taken=2):
    it = iter(ds)
    for _ in range(taken):
        next(it)
    return pickle.loads(pickle.dumps(it.state_dict()))


def _pairs(n=10):
    return tp.range(n).map(lambda i: (torch.full((i % 3 + 1,), i), i))


@pytest.mark.parametrize(
    "garble, found",
    [
        (lambda e: "x", "str"),
        (lambda e: {"x": e[0], "y": e[1]}, r"\{'x': tensor\(int64, 1-d\), 'y': int\}"),
        (lambda e: (e[0].float(), e[1]), r"tuple\(tensor\(float32, 1-d\), int\)"),
        (lambda e: (e[0][None], e[1]), r"tuple\(tensor\(int64, 2-d\), int\)"),
        (lambda e: (e[0], str(e[1])), r"tuple\(tensor\(int64, 1-d\), str\)"),
    ],
)
def test_a_buffer_holding_elements_of_another_structure_is_a_checkpoint_error_at_load(
    garble, found
):
    # without the check it loads, and fails later in a batch downstream ("element mixes types")
    ds = _pairs().shuffle(5, seed=0)
    state = _state_mid_buffer(ds)
    buffer = state["pipeline"]["buffer"]
    buffer[2] = garble(buffer[2])
    message = (
        rf"^shuffle: state\['buffer'\] element 2 is {found}, but the op held "
        r"tuple\(tensor\(int64, 1-d\), int\); is the state damaged or from another pipeline\?"
    )
    with pytest.raises(CheckpointError, match=message):
        iter(ds).load_state_dict(state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _pairs(),  # shapes vary
        lambda: tp.from_iterable(["a", "bcd", "", "ef" * 9]),  # ragged strings
        lambda: tp.from_iterable(
            [
                {"a": 1},
                {"a": 1, "b": "x"},
                {"b": 2.0},
                [1, 2],
                [3],
                None,
                torch.zeros(2, 2),
                np.zeros(3, np.uint8),
                torch.zeros(1, dtype=torch.int8),
                (1, "a"),
            ]
        ),
        lambda: tp.from_iterable([list(range(i * 40)) for i in range(6)]),  # long lists
    ],
)
def test_states_whose_elements_legitimately_vary_load(make):
    ds = make().shuffle(4, seed=1)
    assert_checkpoint_roundtrip(ds, max_elements=12)
    state = _state_mid_buffer(ds, taken=3)
    iter(ds).load_state_dict(state)


def test_a_state_without_a_recorded_structure_loads_unchecked():
    ds = _pairs().shuffle(5, seed=0)
    state = _state_mid_buffer(ds)
    rest = _resume(ds, state)
    del state["pipeline"]["structure"]
    assert_same_elements(_resume(ds, state), rest)


def _resume(ds, state):
    it = iter(ds)
    it.load_state_dict(state)
    return list(it)


def test_a_large_buffer_checkpointed_rarely_is_checked_too():
    # more elements arrive between two states than the op keeps by reference: it looks at the buffer
    ds = _pairs(300).shuffle(100, seed=0)
    state = _state_mid_buffer(ds, taken=150)
    iter(ds).load_state_dict(pickle.loads(pickle.dumps(state)))
    state["pipeline"]["buffer"][-1] = {"x": 1}  # 99 held: one was drawn after the top-up
    with pytest.raises(CheckpointError, match=r"element 98 is \{'x': int\}"):
        iter(ds).load_state_dict(state)


def test_a_garbled_state_of_shuffle_repeat_is_a_checkpoint_error():
    ds = _pairs().shuffle(5, seed=0).repeat(2)
    state = _state_mid_buffer(ds, taken=12)
    shuffle = state["pipeline"]["input"]
    shuffle["buffer"][0] = "x"
    with pytest.raises(CheckpointError, match=r"shuffle: state\['buffer'\] element 0 is str"):
        iter(ds).load_state_dict(state)


def test_input_errors_propagate():
    def boom(x):
        if x == 3:
            raise KeyError("bad element")
        return x

    with pytest.raises(KeyError, match="bad element"):
        list(tp.range(6).map(boom).shuffle(2, seed=0))


def test_many_seeds_cover_all_small_permutations_quickly():
    seen = {tuple(shuffled(3, 2, seed)) for seed in range(200)}
    # With buffer 2 over 3 elements, 2 cannot come first: 4 of the 6 orders are reachable.
    reachable = {p for p in itertools.permutations(range(3)) if p[0] != 2}
    assert seen == reachable

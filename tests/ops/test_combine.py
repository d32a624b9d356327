"""zip, concatenate, choose_from_datasets and sample_from_datasets."""

import collections
import pickle

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.errors import CheckpointError
from torchpipe.ops.combine import SampleFromDatasetsNode, ZipNode
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements, node

P = collections.namedtuple("P", "x y")


def filtered(n):
    return tp.range(n).filter(lambda x: True)


def endless(n=3):
    return tp.range(n).repeat()


def const(value):
    return tp.from_tensor_slices([value]).repeat()


# -- zip ----------------------------------------------------------------------------------------
def test_zip_yields_tuples_and_stops_at_the_shortest():
    # verified against tf.data 2.21: zip(range(3), range(10, 15)) -> (0,10), (1,11), (2,12)
    assert list(tp.zip(tp.range(3), tp.range(10, 15))) == [(0, 10), (1, 11), (2, 12)]
    assert list(tp.zip((tp.range(3), tp.range(10, 15)))) == [(0, 10), (1, 11), (2, 12)]
    assert list(tp.range(10, 15).zip(tp.range(3))) == [(10, 0), (11, 1), (12, 2)]
    assert list(tp.range(2).zip(tp.range(5, 9), tp.range(7, 9))) == [(0, 5, 7), (1, 6, 8)]


def test_zip_keeps_dicts_nesting_and_namedtuples():
    # verified against tf.data 2.21
    assert list(tp.zip({"a": tp.range(3), "b": tp.range(5, 7)})) == [
        {"a": 0, "b": 5},
        {"a": 1, "b": 6},
    ]
    nested = tp.zip((tp.range(3), (tp.range(4, 8), {"x": tp.range(9, 12)})))
    assert list(nested) == [(0, (4, {"x": 9})), (1, (5, {"x": 10})), (2, (6, {"x": 11}))]
    out = list(tp.zip(P(tp.range(2), tp.range(3, 9))))
    assert out == [P(0, 3), P(1, 4)] and all(type(e) is P for e in out)


def test_zip_of_tensors_and_arrays():
    a = tp.from_tensor_slices(torch.arange(6).reshape(3, 2))
    b = tp.from_tensor_slices(np.arange(3.0))
    out = list(tp.zip(a, b))
    assert_same_elements(
        out,
        [
            (torch.tensor([0, 1]), np.float64(0.0)),
            (torch.tensor([2, 3]), np.float64(1.0)),
            (torch.tensor([4, 5]), np.float64(2.0)),
        ],
    )


def test_zip_node_accepts_a_lone_dataset_as_the_structure():
    # tf.data.Dataset.zip(a) yields a's elements unwrapped (verified against tf.data 2.21).
    zipped = ZipNode([node(tp.range(3))], tp.range(3))
    assert list(tp.Dataset(zipped)) == [0, 1, 2]


def test_zip_node_rejects_a_structure_of_another_size():
    with pytest.raises(ValueError, match="zip: the structure has 2 datasets, got 1"):
        ZipNode([node(tp.range(3))], (tp.range(1), tp.range(2)))


def test_zip_cardinality():
    # verified against tf.data 2.21: 3, INFINITE, UNKNOWN, UNKNOWN, 0
    assert tp.zip(tp.range(3), endless()).cardinality() == 3
    assert tp.zip(endless(), endless()).cardinality() == tp.INFINITE
    assert tp.zip(filtered(3), tp.range(5)).cardinality() == tp.UNKNOWN
    assert tp.zip(filtered(3), endless()).cardinality() == tp.UNKNOWN
    assert tp.zip(tp.range(0), endless()).cardinality() == 0
    assert len(tp.zip({"a": tp.range(4), "b": tp.range(9)})) == 4


def test_zip_stays_ended():
    it = iter(tp.zip(tp.range(5), tp.range(1)))
    assert next(it) == (0, 0)
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it)


def test_zip_explain():
    text = tp.zip({"a": tp.range(2), "b": tp.range(3)}).explain()
    assert "zip(datasets=2, structure=\"{'a': *, 'b': *}\")" in text


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.zip(tp.range(7), tp.range(10, 15)),
        lambda: tp.zip({"a": tp.range(6).shuffle(3, seed=1), "b": P(tp.range(8), endless())}),
        lambda: tp.zip(tp.range(4), tp.range(3).repeat(2)).repeat(2),
        lambda: tp.zip(tp.range(6), tp.range(6).shuffle(4, seed=2)).shuffle(3, seed=5),
    ],
)
def test_zip_checkpoint_roundtrip(make):
    assert assert_checkpoint_roundtrip(make())


# -- concatenate --------------------------------------------------------------------------------
def test_concatenate():
    # verified against tf.data 2.21: range(3).concatenate(range(10, 12)) -> 0, 1, 2, 10, 11
    assert list(tp.range(3).concatenate(tp.range(10, 12))) == [0, 1, 2, 10, 11]
    assert list(tp.range(0).concatenate(tp.range(2))) == [0, 1]
    assert list(tp.range(2).concatenate(tp.range(0))) == [0, 1]
    assert list(tp.range(2).concatenate(tp.range(1)).concatenate(tp.range(5, 6))) == [0, 1, 0, 5]


def test_concatenate_cardinality():
    # verified against tf.data 2.21: 5, INFINITE, INFINITE, UNKNOWN
    assert tp.range(3).concatenate(tp.range(2)).cardinality() == 5
    assert filtered(3).concatenate(endless()).cardinality() == tp.INFINITE
    assert endless().concatenate(filtered(3)).cardinality() == tp.INFINITE
    assert filtered(3).concatenate(tp.range(2)).cardinality() == tp.UNKNOWN


def test_concatenate_builds_the_second_input_when_the_first_ends():
    ds = tp.range(2).concatenate(tp.from_iterable(lambda: iter([7, 8])))
    it = iter(ds.with_options(tp.Options(optimizations={"inject_prefetch": False})))
    assert next(it) == 0
    stages = [s["stage"] for s in it.stats()]
    assert stages == ["concatenate", "range"]
    assert list(it) == [1, 7, 8]


def test_concatenate_stays_ended():
    it = iter(tp.range(1).concatenate(tp.range(1)))
    assert list(it) == [0, 0]
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.range(4).concatenate(tp.range(10, 13)),
        lambda: tp.range(0).concatenate(tp.range(3)),
        lambda: tp.range(3).concatenate(tp.range(5).shuffle(5, seed=1)).repeat(2),
        lambda: tp.range(3).repeat(2).concatenate(tp.range(4).shuffle(2)),
        lambda: tp.range(5).concatenate(tp.range(5, 9)).shuffle(4, seed=3),
        lambda: tp.range(3).concatenate(endless()),
    ],
)
def test_concatenate_checkpoint_roundtrip(make):
    assert assert_checkpoint_roundtrip(make(), max_elements=30)


# -- choose_from_datasets ---------------------------------------------------------------------
def test_choose_from_datasets_docs_example():
    # verified against tf.data 2.21 (tf yields bytes; torchpipe keeps the Python str)
    datasets = [const("foo"), const("bar"), const("baz")]
    out = list(tp.choose_from_datasets(datasets, tp.range(3).repeat(3)))
    assert out == ["foo", "bar", "baz"] * 3


CHOICES = [0, 1, 1, 1, 0, 0, 0, 1, 0]


def test_choose_stops_when_the_chosen_dataset_is_empty():
    # verified against tf.data 2.21: [0, 10, 11]
    ds = tp.choose_from_datasets([tp.range(3), tp.range(10, 12)], tp.from_tensor_slices(CHOICES))
    assert list(ds) == [0, 10, 11]


def test_choose_skips_empty_datasets_when_asked():
    # verified against tf.data 2.21: [0, 10, 11, 1, 2]
    choice = tp.from_tensor_slices(CHOICES)
    ds = tp.choose_from_datasets(
        [tp.range(3), tp.range(10, 12)], choice, stop_on_empty_dataset=False
    )
    assert list(ds) == [0, 10, 11, 1, 2]


def test_choose_ends_when_every_dataset_is_exhausted():
    # verified against tf.data 2.21: an endless choice over exhausted inputs ends: [0, 10, 1, 11, 12]
    choice = tp.from_tensor_slices([0, 1]).repeat()
    ds = tp.choose_from_datasets(
        [tp.range(2), tp.range(10, 13)], choice, stop_on_empty_dataset=False
    )
    assert list(ds) == [0, 10, 1, 11, 12]


@pytest.mark.parametrize(
    "choice",
    [np.int64(1), np.uint8(1), torch.tensor(1), torch.tensor(1, dtype=torch.int32), np.array(1)],
)
def test_choose_accepts_integer_scalars(choice):
    ds = tp.choose_from_datasets([tp.range(2), tp.range(10, 12)], tp.from_iterable([0, choice]))
    assert list(ds) == [0, 10]


@pytest.mark.parametrize(
    "choice",
    [
        1.0,
        True,
        np.bool_(True),
        torch.tensor(1.0),
        torch.tensor([1]),
        torch.tensor(True),
        np.array([1]),
        "1",
        None,
    ],
)
def test_choose_rejects_non_integer_choices(choice):
    ds = tp.choose_from_datasets([tp.range(2), tp.range(10, 12)], tp.from_iterable([0, choice]))
    with pytest.raises(
        TypeError, match="choose_from_datasets: choice element 1 must be an integer scalar"
    ):
        list(ds)


@pytest.mark.parametrize("choice", [2, -1, torch.tensor(5)])
def test_choose_rejects_out_of_range_choices(choice):
    # tf.data raises InvalidArgumentError "Selector index out of range" for these.
    ds = tp.choose_from_datasets([tp.range(2), tp.range(10, 12)], tp.from_iterable([choice]))
    with pytest.raises(
        ValueError, match=f"choice element 0 is {int(choice)}, out of range for 2 datasets"
    ):
        list(ds)


def test_choose_cardinality():
    # verified against tf.data 2.21: UNKNOWN, INFINITE, UNKNOWN
    a, b = tp.range(3), tp.range(10, 12)
    assert (
        tp.choose_from_datasets([a, b], tp.from_tensor_slices(CHOICES)).cardinality() == tp.UNKNOWN
    )
    assert (
        tp.choose_from_datasets([a, endless()], tp.from_tensor_slices(CHOICES)).cardinality()
        == tp.INFINITE
    )
    assert tp.choose_from_datasets([a, b], tp.range(2).repeat()).cardinality() == tp.UNKNOWN


def test_choose_explain():
    ds = tp.choose_from_datasets(
        [tp.range(3), tp.range(2)], tp.range(2), stop_on_empty_dataset=False
    )
    assert "choose_from_datasets(datasets=2, stop_on_empty_dataset=False)" in ds.explain()


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.choose_from_datasets(
            [tp.range(3), tp.range(10, 12)], tp.from_tensor_slices(CHOICES)
        ),
        lambda: tp.choose_from_datasets(
            [tp.range(3), tp.range(10, 12)],
            tp.from_tensor_slices(CHOICES),
            stop_on_empty_dataset=False,
        ),
        lambda: tp.choose_from_datasets(
            [tp.range(4).shuffle(4, seed=1), tp.range(10, 14)],
            tp.range(2).repeat(4).shuffle(8, seed=2),
        ).repeat(2),
        lambda: tp.choose_from_datasets(
            [tp.range(3).repeat(2), tp.range(10, 12)],
            tp.from_tensor_slices(CHOICES),
            stop_on_empty_dataset=False,
        ).shuffle(3, seed=4),
    ],
)
def test_choose_checkpoint_roundtrip(make):
    assert assert_checkpoint_roundtrip(make())


# -- sample_from_datasets ---------------------------------------------------------------------
def test_sample_draws_every_element_once_when_not_stopping():
    a, b, c = tp.range(10), tp.range(100, 105), tp.range(200, 220)
    out = list(tp.sample_from_datasets([a, b, c], weights=[0.2, 0.3, 0.5], seed=1))
    assert sorted(out) == [*range(10), *range(100, 105), *range(200, 220)]
    for lo, hi in ((0, 10), (100, 105), (200, 220)):
        assert [x for x in out if lo <= x < hi] == list(range(lo, hi))  # each input keeps its order


def test_sample_stops_at_the_first_exhausted_draw_when_asked():
    lengths = set()
    for seed in range(20):
        out = list(
            tp.sample_from_datasets(
                [tp.range(5), tp.range(100, 105)], seed=seed, stop_on_empty_dataset=True
            )
        )
        from_a = [x for x in out if x < 100]
        from_b = [x for x in out if x >= 100]
        assert from_a == list(range(len(from_a))) and from_b == list(range(100, 100 + len(from_b)))
        assert len(from_a) == 5 or len(from_b) == 5  # it ends only once an input ran out
        lengths.add(len(out))
        # Same seed, same draws: without stopping, the output goes on from there.
        full = list(tp.sample_from_datasets([tp.range(5), tp.range(100, 105)], seed=seed))
        assert full[: len(out)] == out
    assert min(lengths) < 10  # ... and then as soon as that input is drawn again


def test_sample_never_draws_a_zero_weight_dataset():
    # verified against tf.data 2.21: the zero-weight input is dropped, the others drain fully
    built = []

    def never():
        built.append(1)
        return iter([-1])

    ds = tp.sample_from_datasets(
        [tp.range(5), tp.from_iterable(never), tp.range(1000, 1003)],
        weights=[0.5, 0.0, 0.5],
        seed=2,
    )
    assert sorted(ds) == [0, 1, 2, 3, 4, 1000, 1001, 1002] and not built


def test_sample_frequencies_follow_the_weights():
    weights = [0.2, 0.3, 0.5]
    ds = tp.sample_from_datasets([const(0), const(1), const(2)], weights=weights, seed=7).take(6000)
    counts = collections.Counter(ds)
    for i, w in enumerate(weights):
        assert abs(counts[i] / 6000 - w) < 0.025, counts  # ~4 standard deviations


def test_sample_uniform_by_default():
    counts = collections.Counter(tp.sample_from_datasets([const(0), const(1)], seed=3).take(4000))
    assert abs(counts[0] - 2000) < 130, counts


def test_sample_is_deterministic_with_a_seed_and_the_same_every_epoch():
    # tf.data 2.21 (rerandomize_each_iteration=None): the same sequence every epoch and repetition
    def build():
        return tp.sample_from_datasets([tp.range(5), tp.range(100, 105)], seed=1)

    ds = build()
    first = list(ds)
    assert list(ds) == first and list(build()) == first
    assert list(ds.repeat(2)) == first * 2
    others = {
        tuple(tp.sample_from_datasets([tp.range(5), tp.range(100, 105)], seed=s))
        for s in range(2, 8)
    }
    assert len(others | {tuple(first)}) > 1


def test_sample_uses_the_pipeline_seed():
    def build(seed):
        ds = tp.sample_from_datasets([tp.range(10), tp.range(100, 110)])
        return ds.with_options(tp.Options(seed=seed))

    assert list(build(4)) == list(build(4))
    assert list(build(4)) != list(build(5))


def test_sample_cardinality():
    # verified against tf.data 2.21: UNKNOWN, INFINITE, INFINITE, and 3 when only one input can be drawn
    a, b = tp.range(3), tp.range(10, 12)
    assert tp.sample_from_datasets([a, b]).cardinality() == tp.UNKNOWN
    assert tp.sample_from_datasets([a, endless()]).cardinality() == tp.INFINITE
    assert tp.sample_from_datasets([endless(), endless()]).cardinality() == tp.INFINITE
    assert tp.sample_from_datasets([a, endless()], weights=[1.0, 0.0]).cardinality() == 3
    assert len(tp.sample_from_datasets([a], stop_on_empty_dataset=True)) == 3


def test_sample_explain():
    ds = tp.sample_from_datasets([tp.range(3), tp.range(2)], weights=[1, 3], seed=5)
    assert (
        "sample_from_datasets(weights=[0.25, 0.75], seed=5, stop_on_empty_dataset=False)"
        in ds.explain()
    )


def test_sample_node_checks_its_weights():
    nodes = [node(tp.range(2)), node(tp.range(3))]
    with pytest.raises(ValueError, match="expected 2 weights"):
        SampleFromDatasetsNode(nodes, [1.0], None, False)
    with pytest.raises(ValueError, match="non-negative"):
        SampleFromDatasetsNode(nodes, [0.0, 0.0], None, False)


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.sample_from_datasets([tp.range(6), tp.range(100, 104)], seed=1),
        lambda: tp.sample_from_datasets(
            [tp.range(6), tp.range(100, 104)], seed=1, stop_on_empty_dataset=True
        ),
        lambda: tp.sample_from_datasets(
            [tp.range(4), tp.range(10, 12), tp.range(20, 23)], weights=[0.5, 0.0, 0.5]
        ).with_options(tp.Options(seed=3)),
        lambda: tp.sample_from_datasets(
            [tp.range(4).shuffle(4, seed=1), tp.range(10, 13)], seed=2
        ).repeat(2),
        lambda: tp.sample_from_datasets([tp.range(5).repeat(2), endless()], seed=2).shuffle(
            4, seed=3
        ),
    ],
)
def test_sample_checkpoint_roundtrip(make):
    assert assert_checkpoint_roundtrip(make(), max_elements=40)


def test_sample_state_marks_exhausted_inputs():
    it = iter(
        tp.sample_from_datasets([tp.range(1), tp.range(100, 120)], weights=[0.9, 0.1], seed=0)
    )
    out = [next(it) for _ in range(5)]
    assert 0 in out
    state = pickle.loads(pickle.dumps(it.state_dict()))
    assert state["pipeline"]["inputs"][0] is None
    resumed = iter(
        tp.sample_from_datasets([tp.range(1), tp.range(100, 120)], weights=[0.9, 0.1], seed=0)
    )
    resumed.load_state_dict(state)
    assert list(resumed) == list(it)


# -- malformed states ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, key, stage",
    [
        (lambda: tp.zip(tp.range(3), tp.range(3)), "inputs", "zip"),
        (lambda: tp.range(2).concatenate(tp.range(2)), "index", "concatenate"),
        (
            lambda: tp.choose_from_datasets([tp.range(2)], tp.range(1)),
            "choice",
            "choose_from_datasets",
        ),
        (
            lambda: tp.sample_from_datasets([tp.range(2), tp.range(2)]),
            "rng",
            "sample_from_datasets",
        ),
    ],
)
def test_a_malformed_state_is_rejected(make, key, stage):
    ds = make()
    state = iter(ds).state_dict()
    del state["pipeline"][key]
    with pytest.raises(CheckpointError, match=stage):
        iter(ds).load_state_dict(state)


def test_a_state_with_the_wrong_number_of_inputs_is_rejected():
    ds = tp.zip(tp.range(3), tp.range(3))
    state = iter(ds).state_dict()
    state["pipeline"]["inputs"].pop()
    with pytest.raises(CheckpointError, match="zip: .*1 inputs, the pipeline has 2"):
        iter(ds).load_state_dict(state)

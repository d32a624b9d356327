"""bucket_by_sequence_length: tf.data's buckets, their padding, cardinality and checkpoints."""

import pickle

import numpy as np
import pytest
import torch

import torchpipe as tp
from tests.ops.test_batch import NO_PREFETCH, Pulls, as_lists, sequences
from torchpipe.testing import assert_checkpoint_roundtrip

LENGTHS = [3, 1, 5, 2, 7, 4, 1, 6, 2, 8, 3]


def bucketed(lengths=LENGTHS, boundaries=(3, 6), sizes=(2, 3, 2), **kwargs):
    ds = sequences(lengths).bucket_by_sequence_length(
        lambda x: x.shape[0], list(boundaries), list(sizes), **kwargs
    )
    return as_lists(ds)


def test_bucket_emits_full_buckets_then_flushes_in_bucket_order():
    # verified against tf.data 2.21
    assert bucketed() == [
        [[2, 0], [4, 4]],
        [[1, 1, 1, 0, 0], [3, 3, 3, 3, 3], [6, 6, 6, 6, 0]],
        [[5, 5, 5, 5, 5, 5, 5], [8, 8, 8, 8, 8, 8, 0]],
        [[7, 0], [9, 9]],
        [[11, 11, 11]],
        [[10, 10, 10, 10, 10, 10, 10, 10]],
    ]
    # verified against tf.data 2.21: the flush goes by bucket id, not by arrival
    assert bucketed([7, 4, 1, 5]) == [
        [[3]],
        [[2, 2, 2, 2, 0], [4, 4, 4, 4, 4]],
        [[1, 1, 1, 1, 1, 1, 1]],
    ]


def test_bucket_drop_remainder_drops_the_flushed_partial_buckets():
    # verified against tf.data 2.21
    assert bucketed(drop_remainder=True) == [
        [[2, 0], [4, 4]],
        [[1, 1, 1, 0, 0], [3, 3, 3, 3, 3], [6, 6, 6, 6, 0]],
        [[5, 5, 5, 5, 5, 5, 5], [8, 8, 8, 8, 8, 8, 0]],
        [[7, 0], [9, 9]],
    ]


def test_bucket_padding_values():
    # verified against tf.data 2.21
    expected = [[[2, -1], [4, 4]], [[1, 1, 1, -1, -1], [3, 3, 3, 3, 3], [6, 6, 6, 6, -1]]]
    assert bucketed(padding_values=-1)[:2] == expected


def test_bucket_pad_to_bucket_boundary():
    # verified against tf.data 2.21
    assert bucketed(boundaries=(3, 9), pad_to_bucket_boundary=True) == [
        [[2, 0], [4, 4]],
        [[1, 1, 1, 0, 0, 0, 0, 0], [3, 3, 3, 3, 3, 0, 0, 0], [5, 5, 5, 5, 5, 5, 5, 0]],
        [[7, 0], [9, 9]],
        [[6, 6, 6, 6, 0, 0, 0, 0], [8, 8, 8, 8, 8, 8, 0, 0], [10, 10, 10, 10, 10, 10, 10, 10]],
        [[11, 11, 11, 0, 0, 0, 0, 0]],
    ]
    with pytest.raises(
        ValueError, match=r"bucket_by_sequence_length\(<lambda>\): element 4 has length 7"
    ):
        bucketed(pad_to_bucket_boundary=True)


def tuple_sequences():
    lengths = [2, 5, 1, 4, 3]
    return tp.range(5).map(lambda i: (np.full([lengths[i], 2], i + 0.5, np.float32), i))


def test_bucket_unpacks_tuples_and_pads_dimension_zero_to_the_boundary():
    calls = []

    def length(x, label):
        calls.append(label)
        return x.shape[0]

    out = list(
        tuple_sequences().bucket_by_sequence_length(
            length, [3, 6], [2, 2, 2], pad_to_bucket_boundary=True
        )
    )
    # verified against tf.data 2.21 (static shape [None, 2]: only dimension 0 is filled)
    assert out[0][0].tolist() == [[[0.5, 0.5], [0.5, 0.5]], [[2.5, 2.5], [0.0, 0.0]]]
    assert out[1][0].shape == (2, 5, 2) and out[2][0].shape == (1, 5, 2)
    assert [y.tolist() for _, y in out] == [[0, 2], [1, 3], [4]]
    assert calls == [0, 1, 2, 3, 4]


def test_bucket_explicit_padded_shapes_fill_unknown_dims_to_the_boundary():
    ds = tuple_sequences().bucket_by_sequence_length(
        lambda x, y: x.shape[0],
        [3, 6],
        [2, 2, 2],
        padded_shapes=([None, 3], []),
        padding_values=(-1.0, 0),
        pad_to_bucket_boundary=True,
    )
    out = list(ds)
    # verified against tf.data 2.21
    assert out[0][0].tolist() == [
        [[0.5, 0.5, -1.0], [0.5, 0.5, -1.0]],
        [[2.5, 2.5, -1.0], [-1.0, -1.0, -1.0]],
    ]
    assert out[2][0].tolist() == [[[4.5, 4.5, -1.0]] * 3 + [[-1.0, -1.0, -1.0]] * 2]


def test_bucket_length_func_must_return_an_int():
    ds = sequences([2, 3]).bucket_by_sequence_length(lambda x: float(x.shape[0]), [3], [2, 2])
    with pytest.raises(
        TypeError, match=r"bucket_by_sequence_length\(<lambda>\): .*must return an int, got float"
    ):
        list(ds)
    tensor_length = sequences([2, 3]).bucket_by_sequence_length(
        lambda x: torch.tensor(x.shape[0]), [3], [2, 2]
    )
    assert as_lists(tensor_length) == [[[1, 1]], [[2, 2, 2]]]


def test_bucket_cardinality_and_explain():
    ds = sequences(LENGTHS).bucket_by_sequence_length(len, [3, 6], [2, 3, 2])
    # verified against tf.data 2.21: unknown, or infinite for an infinite input
    assert ds.cardinality() == tp.UNKNOWN
    assert (
        sequences(LENGTHS).repeat().bucket_by_sequence_length(len, [3], [2, 2]).cardinality()
        == tp.INFINITE
    )
    assert (
        "bucket_by_sequence_length(element_length_func=len, bucket_boundaries=[3, 6]"
        in ds.explain()
    )


def test_bucket_padding_values_that_do_not_fit_raise_at_the_first_element():
    pulls = Pulls()
    ds = (
        sequences([3, 1, 4, 1, 5])
        .map(pulls)
        .bucket_by_sequence_length(len, [3], [2, 2], padding_values="x")
    )
    with pytest.raises(
        TypeError, match=r"^bucket_by_sequence_length\(len\): padding_values for element .* got str"
    ):
        next(iter(ds.with_options(NO_PREFETCH)))
    assert pulls.calls == 1


# -- checkpoints ------------------------------------------------------------------------------
RANDOM_LENGTHS = np.random.default_rng(0).integers(1, 12, 30).tolist()


def random_buckets(ds, boundaries=(3, 6, 9), **kwargs):
    return ds.bucket_by_sequence_length(
        lambda x: x.shape[0], list(boundaries), [2, 3, 2, 4], **kwargs
    )


PIPELINES = {
    "bucket": lambda: random_buckets(sequences(RANDOM_LENGTHS)),
    "bucket_drop_under_repeat": lambda: random_buckets(
        sequences(RANDOM_LENGTHS), drop_remainder=True
    ).repeat(2),
    "bucket_over_repeat_shuffle": lambda: random_buckets(
        sequences(RANDOM_LENGTHS).repeat(2).shuffle(7, seed=1),
        (3, 6, 12),
        pad_to_bucket_boundary=True,
        padding_values=-1,
    ),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_checkpoint_roundtrip(name):
    elements = assert_checkpoint_roundtrip(PIPELINES[name]())
    assert elements


@pytest.mark.parametrize(
    "garble, found",
    [
        (lambda e: "x", "str"),
        (lambda e: (e,), r"tuple\(tensor\(int64, 1-d\)\)"),
        (lambda e: e.float(), r"tensor\(float32, 1-d\)"),
    ],
)
def test_bucket_state_holding_elements_of_another_structure_is_a_checkpoint_error_at_load(
    garble, found
):
    ds = sequences([1, 4, 7])
    it = iter(random_buckets(ds))
    next(it)
    state = pickle.loads(pickle.dumps(it.state_dict()))
    bucket = state["pipeline"]["buckets"][2]
    bucket[0] = garble(bucket[0])
    message = (
        rf"^bucket_by_sequence_length\(<lambda>\): state\['buckets'\] element 1 is {found}, but the op held "
        r"tensor\(int64, 1-d\)"
    )
    with pytest.raises(tp.CheckpointError, match=message):
        iter(random_buckets(ds)).load_state_dict(state)


def test_bucket_checkpoint_holds_the_partial_buckets():
    ds = sequences([1, 4, 7])
    it = iter(random_buckets(ds))
    state = it.state_dict()
    first = next(it)  # the end of input flushes bucket 0 first
    assert first.tolist() == [[1]]
    mid = it.state_dict()
    assert [len(b) for b in mid["pipeline"]["buckets"]] == [0, 1, 1, 0]
    resumed = iter(random_buckets(ds))
    resumed.load_state_dict(mid)
    assert as_lists(resumed) == [[[2, 2, 2, 2]], [[3, 3, 3, 3, 3, 3, 3]]]
    assert state["pipeline"]["buckets"] == [[], [], [], []]

"""Dataset: chain methods check their arguments at the call that made the mistake."""

import pickle

import pytest
import torch

import torchpipe as tp

ds = tp.range(10)
fn = lambda x: x  # noqa: E731


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ds.map(5), TypeError, "map: fn must be callable"),
        (lambda: ds.map(fn, num_parallel_calls=0), ValueError, "num_parallel_calls must be >= 1"),
        (lambda: ds.map(fn, num_parallel_calls=-2), ValueError, "num_parallel_calls"),
        (
            lambda: ds.map(fn, num_parallel_calls=2.0),
            TypeError,
            "num_parallel_calls must be an int",
        ),
        (lambda: ds.map(fn, deterministic="yes"), TypeError, "deterministic must be a bool"),
        (lambda: ds.map(fn, executor="gpu"), ValueError, "executor must be one of"),
        (lambda: ds.map(fn, name=3), TypeError, "name must be a str"),
        (lambda: ds.filter(None), TypeError, "filter: predicate"),
        (lambda: ds.flat_map(1), TypeError, "flat_map"),
        (lambda: ds.interleave(fn, cycle_length=0), ValueError, "cycle_length"),
        (lambda: ds.interleave(fn, block_length=0), ValueError, "block_length"),
        (lambda: ds.interleave(fn, num_parallel_calls=0), ValueError, "num_parallel_calls"),
        (lambda: ds.batch(0), ValueError, "batch: batch_size must be >= 1"),
        (lambda: ds.batch(-3), ValueError, "batch_size"),
        (lambda: ds.batch(2.5), TypeError, "batch_size must be an int"),
        (lambda: ds.batch(True), TypeError, "batch_size must be an int"),
        (lambda: ds.batch(2, drop_remainder=1), TypeError, "drop_remainder must be a bool"),
        (lambda: ds.batch(2, collate_fn=3), TypeError, "collate_fn"),
        (lambda: ds.padded_batch(0), ValueError, "padded_batch"),
        (lambda: ds.rebatch([]), TypeError, "rebatch"),
        (lambda: ds.rebatch([2, 0]), ValueError, "rebatch"),
        (lambda: ds.rebatch("2"), TypeError, "rebatch"),
        (lambda: ds.bucket_by_sequence_length(fn, [3, 2], [1, 1, 1]), ValueError, "increase"),
        (
            lambda: ds.bucket_by_sequence_length(fn, [2, 3], [1, 1]),
            ValueError,
            r"len\(bucket_boundaries\) \+ 1",
        ),
        (lambda: ds.bucket_by_sequence_length(fn, [2], [1, 0]), ValueError, "bucket_batch_sizes"),
        (lambda: ds.shuffle(0), ValueError, "shuffle: buffer_size must be >= 1"),
        (lambda: ds.shuffle(10, seed=-1), ValueError, "seed"),
        (lambda: ds.shuffle(10, seed="a"), TypeError, "seed"),
        (
            lambda: ds.shuffle(10, reshuffle_each_iteration=None),
            TypeError,
            "reshuffle_each_iteration",
        ),
        (lambda: ds.repeat(-2), ValueError, "repeat: count must be >= -1"),
        (lambda: ds.take(-5), ValueError, "take"),
        (lambda: ds.skip(None), TypeError, "skip"),
        (lambda: ds.take_while(3), TypeError, "take_while"),
        (lambda: ds.shard(0, 0), ValueError, "num_shards"),
        (lambda: ds.shard(3, 3), ValueError, "index must be < num_shards"),
        (lambda: ds.shard(3, -1), ValueError, "index"),
        (lambda: ds.zip([1]), TypeError, "zip: expected a tp.Dataset"),
        (lambda: ds.concatenate(range(3)), TypeError, "concatenate"),
        (lambda: ds.cache(3), TypeError, "cache: path"),
        (lambda: ds.prefetch(-3), ValueError, "prefetch"),
        (lambda: ds.apply(lambda d: 3), TypeError, "apply: fn must return a tp.Dataset"),
        (lambda: ds.with_options({"seed": 1}), TypeError, "with_options"),
        (lambda: ds.scan(0, None), TypeError, "scan"),
        (lambda: ds.enumerate("0"), TypeError, "enumerate"),
    ],
)
def test_bad_arguments_fail_at_the_call(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_dataset_is_an_immutable_iterable_dataset():
    a = tp.range(5)
    b = a.map(lambda x: x + 1)
    assert isinstance(a, torch.utils.data.IterableDataset) and isinstance(a, tp.Dataset)
    assert list(a) == [0, 1, 2, 3, 4] and list(b) == [1, 2, 3, 4, 5]
    with pytest.raises(TypeError):
        tp.Dataset("not a node")


def test_torch_dataloader_can_iterate_a_pipeline():
    loader = torch.utils.data.DataLoader(tp.range(6).map(lambda x: float(x)), batch_size=4)
    batches = list(loader)
    assert [b.tolist() for b in batches] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]


def test_len_and_cardinality():
    assert len(tp.range(7).take(3)) == 3
    with pytest.raises(TypeError, match="infinite"):
        len(tp.range(2).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(tp.range(4).filter(lambda x: True))
    assert tp.range(2).repeat().cardinality() == tp.INFINITE
    assert tp.range(4).filter(lambda x: True).cardinality() == tp.UNKNOWN


def test_apply_and_explain_and_repr():
    def twice(d):
        return d.map(lambda x: 2 * x, name="double")

    out = tp.range(3).apply(twice)
    assert list(out) == [0, 2, 4]
    text = out.explain()
    assert "map(fn=<lambda>) as 'double'" in text and "range(start=0, stop=3, step=1)" in text
    assert "Cardinality: 3" in text
    assert repr(out).startswith("<tp.Dataset map(")


def test_each_iter_is_a_new_epoch_and_iterators_are_independent():
    ds = tp.range(4)
    a, b = iter(ds), iter(ds)
    assert next(a) == 0 and next(a) == 1 and next(b) == 0
    assert a.state_dict()["epoch"] + 1 == b.state_dict()["epoch"]


def test_a_pipeline_pickles_and_its_copy_starts_afresh():
    ds = tp.range(6).shuffle(6, seed=3).batch(2)
    first = [b.tolist() for b in ds]
    copy = pickle.loads(pickle.dumps(ds))
    assert [b.tolist() for b in copy] == first  # epoch 0 again: a copy for a spawned worker

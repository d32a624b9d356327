"""A pipeline iterated in a torch DataLoader worker yields that worker's share: every element once in all."""

import collections
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip
from tests.workers import as_torch_worker


def _through_workers(ds, num_workers=2, **kwargs):
    return list(DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs))


def _once_each(elements, expected):
    assert collections.Counter(elements) == collections.Counter(expected), "not every element exactly once"


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [2, 3])
def test_torch_dataloader_with_workers_yields_every_element_once_in_order(num_workers):
    ds = tp.range(40).map(lambda x: x * 2)
    # torch takes one element from each worker in turn: every num_workers-th element each gives
    # back the pipeline's own order
    assert _through_workers(ds, num_workers) == list(ds)


class OwnShareOnly(torch.utils.data.Dataset):
    """Fails when a worker reads an index that is another worker's."""

    def __len__(self):
        return 30

    def __getitem__(self, i):
        info = get_worker_info()
        if info is not None and i % info.num_workers != info.id:
            raise AssertionError(f"worker {info.id} read index {i}")
        return i


@pytest.mark.parametrize(
    "make",
    [
        lambda: tp.from_dataset(OwnShareOnly()),
        lambda: tp.from_dataset(OwnShareOnly()).map(lambda x: x + 1, num_parallel_calls=2, executor="thread"),
        lambda: tp.from_dataset(OwnShareOnly()).shuffle(8).batch(4, drop_remainder=False),
    ],
)
def test_a_source_that_seeks_reads_only_its_share(make):
    out = _through_workers(make())
    flat = [int(x) for item in out for x in (item.tolist() if torch.is_tensor(item) else [item])]
    _once_each(flat, [int(x) for item in make() for x in (item.tolist() if torch.is_tensor(item) else [item])])


def test_an_iterable_source_of_unknown_length_is_sharded_by_element_index():
    ds = tp.from_iterable(lambda: (i * i for i in range(25))).filter(lambda x: x % 2 == 0)
    assert ds.cardinality() == tp.UNKNOWN
    _once_each(_through_workers(ds), list(ds))


def test_several_sources_shard_the_output_and_workers_share_their_seed():
    ds = tp.zip(tp.range(20).shuffle(20), tp.range(100, 120))
    assert "each runs the whole pipeline (2 sources)" in ds.explain()
    out = _through_workers(ds)
    _once_each([b for _, b in out], range(100, 120))
    _once_each([a for a, _ in out], range(20))  # the workers shuffled alike
    torch.manual_seed(7)
    first = _through_workers(ds)
    torch.manual_seed(7)
    assert _through_workers(ds) == first  # torch's seed decides the order, as with torch's own datasets


def test_a_shared_cache_file_shards_the_output(tmp_path):
    ds = tp.range(12).map(lambda x: x + 1).cache(tmp_path / "c")
    assert "a cache file the workers share" in ds.explain()
    _once_each(_through_workers(ds), range(1, 13))
    _once_each(_through_workers(ds), range(1, 13))  # the replay, too


def test_inner_datasets_of_flat_map_are_not_sharded_again():
    ds = tp.range(6).flat_map(lambda n: tp.range(n))
    _once_each(_through_workers(ds), list(ds))


def test_explain_says_where_the_shard_goes():
    ds = tp.from_dataset(OwnShareOnly()).map(lambda x: x, 2)
    assert "In torch DataLoader workers: each keeps one element in num_workers of from_dataset(" in ds.explain()
    assert "which reads only its share" in ds.explain()
    assert "is read whole" in tp.from_iterable([1, 2, 3]).explain()
    with as_torch_worker(1, 3):
        text = ds.explain()
    assert "worker_shard: torch DataLoader worker 1 of 3 keeps one element in 3 of from_dataset(" in text
    assert "shard(num_shards=3, index=1) [torch worker 1 of 3]" in text
    assert "In torch DataLoader workers" not in text


def test_a_worker_resumes_its_own_share_and_refuses_another_workers_state():
    ds = tp.range(20).shuffle(6, seed=3).batch(2)
    with as_torch_worker(1, 2):
        share = [b.tolist() for b in ds]
        assert sorted(x for b in share for x in b) == list(range(1, 20, 2))
        assert_checkpoint_roundtrip(ds)
        it = iter(ds)
        next(it)
        state = it.state_dict()
    with as_torch_worker(0, 2), pytest.raises(tp.CheckpointError, match="op 2 was shard\\(num_shards=2, index=1\\)"):
        iter(ds).load_state_dict(state)
    with pytest.raises(tp.CheckpointError, match="another pipeline"):
        iter(ds).load_state_dict(state)  # the whole pipeline, outside any worker


class ResumingInWorkers(IterableDataset):
    """In each torch worker: a pipeline's pass, and the same pass resumed from a state taken after 3."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def __iter__(self):
        whole = [int(x) for x in self.pipeline]
        it = iter(self.pipeline)
        head = [int(next(it)) for _ in range(3)]
        state = pickle.loads(pickle.dumps(it.state_dict()))
        it.close()
        resumed = iter(self.pipeline)
        resumed.load_state_dict(state)
        yield get_worker_info().id, whole, head + [int(x) for x in resumed]


def test_checkpoints_inside_torch_workers_resume_exactly():
    pipeline = tp.range(30).map(lambda x: x * 3).with_options(tp.Options(seed=5))
    out = _through_workers(ResumingInWorkers(pipeline))
    assert sorted(worker for worker, _, _ in out) == [0, 1]
    for _, whole, resumed in out:
        assert resumed == whole[: len(resumed)] and len(resumed) == len(whole)
    _once_each([x for _, whole, _ in out for x in whole], range(0, 90, 3))

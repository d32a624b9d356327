"""A pipeline iterated in a torch DataLoader worker yields that worker's share: every element once in all."""

import collections
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import torchpipe as tp
from torchpipe.testing import as_torch_worker, assert_checkpoint_roundtrip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _through_workers(ds, num_workers=2, **kwargs):
    return list(DataLoader(ds, batch_size=None, num_workers=num_workers, **kwargs))


def _once_each(elements, expected):
    assert collections.Counter(elements) == collections.Counter(expected), (
        "not every element exactly once"
    )


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
        lambda: tp.from_dataset(OwnShareOnly()).map(
            lambda x: x + 1, num_parallel_calls=2, executor="thread"
        ),
        lambda: tp.from_dataset(OwnShareOnly()).shuffle(8).batch(4, drop_remainder=False),
    ],
)
def test_a_source_that_seeks_reads_only_its_share(make):
    out = _through_workers(make())
    flat = [int(x) for item in out for x in (item.tolist() if torch.is_tensor(item) else [item])]
    _once_each(
        flat,
        [int(x) for item in make() for x in (item.tolist() if torch.is_tensor(item) else [item])],
    )


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
    # torch's seed decides the order, as with torch's own datasets
    assert _through_workers(ds) == first


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
    # the facts: one element in num_workers, of the source, which reads only its share
    plan = ds.explain()
    assert "one element in num_workers of from_dataset(" in plan and "reads only its share" in plan
    assert "is read whole" in tp.from_iterable([1, 2, 3]).explain()
    with as_torch_worker(1, 3):
        text = ds.explain()
    assert (
        "worker_split: torch DataLoader worker 1 of 3 keeps one element in 3 of from_dataset("
        in text
    )
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
    with (
        as_torch_worker(0, 2),
        pytest.raises(tp.CheckpointError, match="op 2 was shard\\(num_shards=2, index=1\\)"),
    ):
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


# -- pipelines the user's code split by hand -------------------------------------------------------
def _tenfold(x):
    return 10 * x


class SplitInIter(IterableDataset):
    """torch's documented idiom: ``__iter__`` asks ``get_worker_info()`` and builds its worker's
    share, here with ``make(num_workers, id)``."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        info = get_worker_info()
        n, k = (info.num_workers, info.id) if info is not None else (1, 0)
        return iter(self.make(n, k))


class StartEnd(IterableDataset):
    """torch's other idiom: ``worker_init_fn`` sets each worker's copy's ``start``/``end``."""

    def __init__(self, n, options=None):
        self.start, self.end, self.options = 0, n, options

    def __iter__(self):
        ds = tp.range(self.start, self.end).map(_tenfold)
        return iter(ds.with_options(self.options) if self.options is not None else ds)


def _start_end(worker_id):
    info = get_worker_info()
    per = -(-info.dataset.end // info.num_workers)
    info.dataset.start, info.dataset.end = (
        worker_id * per,
        min(info.dataset.end, (worker_id + 1) * per),
    )


class Wraps(IterableDataset):
    """Code of the user's that iterates a pipeline without splitting it."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        return iter(self.ds)


_FILES = [f"part-{i:02d}" for i in range(12)]

HAND_SPLITS = {
    "shard in __iter__": lambda n, k: tp.range(40).shard(n, k).map(_tenfold).batch(4).unbatch(),
    "range in __iter__": lambda n, k: tp.range(k, 40, n).map(_tenfold),
    "share_of_files in __iter__": lambda n, k: tp.from_tensor_slices(
        tp.distributed.share_of_files(_FILES)
    ),
}


def _elements(loader):
    return [x if isinstance(x, str) else int(x) for x in loader]


@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create", "ignore:torchpipe. a pipeline is iterated"
)
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("idiom", sorted(HAND_SPLITS))
def test_a_pipeline_split_by_hand_in_iter_is_not_split_again(idiom, num_workers):
    got = _elements(
        DataLoader(SplitInIter(HAND_SPLITS[idiom]), batch_size=None, num_workers=num_workers)
    )
    _once_each(got, _FILES if "files" in idiom else [10 * x for x in range(40)])


@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create", "ignore:torchpipe. a pipeline is iterated"
)
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_a_pipeline_split_by_hand_in_worker_init_fn_is_not_split_again(num_workers):
    loader = DataLoader(
        StartEnd(40), batch_size=None, num_workers=num_workers, worker_init_fn=_start_end
    )
    _once_each(_elements(loader), [10 * x for x in range(40)])
    off = tp.Options(distribute=tp.DistributeOptions(policy="off"))  # says so: no warning either
    loader = DataLoader(
        StartEnd(40, off), batch_size=None, num_workers=num_workers, worker_init_fn=_start_end
    )
    _once_each(_elements(loader), [10 * x for x in range(40)])


_LOADERS = {
    **{idiom: (lambda make=make: SplitInIter(make), {}) for idiom, make in HAND_SPLITS.items()},
    "worker_init_fn": (lambda: StartEnd(40), {"worker_init_fn": _start_end}),
    "not split": (lambda: Wraps(tp.range(40).map(_tenfold)), {}),
}


@pytest.mark.filterwarnings("ignore:torchpipe. a pipeline is iterated")
@pytest.mark.parametrize("num_workers", [2, "auto"])
@pytest.mark.parametrize("idiom", sorted(_LOADERS))
def test_tp_dataloader_replicas_leave_a_split_by_hand_alone(idiom, num_workers):
    make, kwargs = _LOADERS[idiom]
    loader = tp.DataLoader(make(), batch_size=None, num_workers=num_workers, **kwargs)
    _once_each(_elements(loader), _FILES if "files" in idiom else [10 * x for x in range(40)])


def test_get_worker_info_imported_before_torchpipe_is_watched_too():
    script = (
        "from torch.utils.data import DataLoader, IterableDataset, get_worker_info\n"
        "import torchpipe as tp\n"
        "class D(IterableDataset):\n"
        "    def __iter__(self):\n"
        "        info = get_worker_info()\n"
        "        return iter(tp.range(info.id, 40, info.num_workers))\n"
        "print(sorted(int(x) for x in DataLoader(D(), batch_size=None, num_workers=2)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=50,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(list(range(40)))
    assert (
        "does not split it again" in out.stderr and "comes 2 times" in out.stderr
    )  # the warning, worker 0


def _asks_then_builds(ds):
    get_worker_info()  # for a seed, say: it did not split
    return ds


def test_code_that_asked_get_worker_info_is_warned_at_the_first_element_naming_both_risks():
    ds = tp.range(12)
    with as_torch_worker(0, 2):
        it = iter(_asks_then_builds(ds))
        with warnings.catch_warnings(record=True) as at_iter:
            warnings.simplefilter("always")
            explained = ds.explain()
        with pytest.warns(UserWarning) as caught:  # noqa: PT030 - its text is checked below
            first = next(it)
        rest = list(it)
    # not split again: every element
    assert not at_iter and first == 0 and rest == list(range(1, 12))
    text = str(caught[0].message)
    assert "comes 2 times" in text and "lose 1 of every 2" in text and "policy=...)): 'off'" in text
    assert (
        "asked torch.utils.data.get_worker_info(), so it splits its data by hand: not split again"
        in explained
    )


def test_policy_off_or_data_says_which_split_and_silences_the_warning():
    off = tp.range(12).with_options(tp.Options(distribute=tp.DistributeOptions(policy="off")))
    data = tp.range(12).with_options(tp.Options(distribute=tp.DistributeOptions(policy="data")))
    with as_torch_worker(1, 2), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(_asks_then_builds(off)) == list(range(12))
        assert list(_asks_then_builds(data)) == list(range(1, 12, 2))
        assert (
            "policy='off'" in off.explain() and "worker 1 of 2 gets every element" in off.explain()
        )


def test_a_shard_that_matches_the_worker_is_named_in_explain():
    ds = tp.range(12).shard(3, 1)
    with as_torch_worker(1, 3):
        assert list(ds) == [1, 4, 7, 10]
        assert "the pipeline shards itself by worker (shard(num_shards=3, index=1)" in ds.explain()
    with as_torch_worker(2, 3):  # another worker's shard: a subset of the user's, split as usual
        assert list(ds) == [
            5
        ]  # worker 2 keeps 2, 5, 8, 11 of the source; the shard, the second of those


def test_where_get_worker_info_cannot_be_watched_the_automatic_split_warns(monkeypatch):
    monkeypatch.setattr("torchpipe.distributed.workers.WATCHING_GET_WORKER_INFO", False)
    ds = tp.range(12)
    with (
        as_torch_worker(0, 2),
        pytest.warns(UserWarning, match="cannot tell whether that code split") as caught,
    ):
        assert list(Wraps(ds)) == list(range(0, 12, 2))
    assert "1 of every 2 elements are lost" in str(caught[0].message)

"""torchpipe.io's file readers split between ranks: TFRecord file lists and WebDataset shards.

Ranks are simulated in this process, with ``DistributeOptions(rank=..., world_size=...)`` as in
tests/distributed/test_ranks.py, or as ``torch.distributed`` reports them (its functions patched);
tests/distributed/test_gloo_ranks.py runs the readers on real ranks that share rank 0's seed.

What is checked: every record reaches exactly one rank (and one torch worker), whole files to a
rank; a reader's own split (``tp.io.split_files``, ``from_webdataset``) is the only one; the
policies (``"off"``, ``"file"``, ``"data"``) and ``split_by_rank=False`` are honoured.
"""

import collections

import pytest
import torch

import torchpipe as tp
from torchpipe.distributed.files import share_of_files
from torchpipe.distributed.nodes import Share
from torchpipe.testing import as_torch_worker, assert_checkpoint_roundtrip


def write_tfrecords(tmp_path, count, per_file=3):
    """``count`` TFRecord files; record ``i`` of file ``f`` is ``f * 100 + i`` as text."""
    paths = []
    for f in range(count):
        paths.append(str(tmp_path / f"train-{f:05d}.tfrecord"))
        with tp.io.TFRecordWriter(paths[-1]) as writer:
            for i in range(per_file):
                writer.write(str(f * 100 + i).encode())
    return paths


def write_shards(tmp_path, count, per_shard=3):
    """``count`` WebDataset shards; sample ``i`` of shard ``f`` has ``cls`` ``f * 100 + i``."""
    for f in range(count):
        with tp.io.TarWriter(str(tmp_path / f"shard-{f:06d}.tar")) as writer:
            for i in range(per_shard):
                writer.write({"__key__": f"s{f}/{i:04d}", "cls": f * 100 + i})
    return str(tmp_path / f"shard-{{000000..{count - 1:06d}}}.tar")


def number(element):
    return int(element["cls"] if isinstance(element, dict) else element)


def on_rank(ds, rank, world_size, seed=7, **distribute):
    distribute.setdefault("uneven", "allow")  # unknown lengths: these ranks cannot agree on an end
    options = tp.DistributeOptions(rank=rank, world_size=world_size, **distribute)
    return ds.with_options(tp.Options(seed=seed, distribute=options))


def shares(make, world_size, **distribute):
    return [
        [number(e) for e in on_rank(make(), rank, world_size, **distribute)]
        for rank in range(world_size)
    ]


def once_each(shares_, expected):
    assert collections.Counter(x for share in shares_ for x in share) == collections.Counter(
        expected
    )


def whole_files(shares_):
    files = [{x // 100 for x in share} for share in shares_]
    assert sum(len(f) for f in files) == len(set().union(*files))  # no file on two ranks
    return files


def records(count, per_file=3):
    return [f * 100 + i for f in range(count) for i in range(per_file)]


@pytest.fixture
def as_torch_distributed(monkeypatch):
    """This process as rank ``rank`` of ``world_size`` as ``torch.distributed`` reports it."""

    def become(rank, world_size):
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world_size)

    return become


# -- TFRecord file lists ---------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("num_parallel_reads", [None, 2])
def test_a_tfrecord_file_list_gives_every_record_to_one_rank(
    tmp_path, world_size, num_parallel_reads
):
    paths = write_tfrecords(tmp_path, 7)

    def make():
        return tp.TFRecordDataset(paths, num_parallel_reads=num_parallel_reads)

    got = shares(make, world_size)
    once_each(got, records(7))
    assert [len(files) for files in whole_files(got)] == [
        len(range(r, 7, world_size)) for r in range(world_size)
    ]
    assert (
        f"distribute: rank 1 of {world_size} keeps one file in {world_size} of from_tensor_slices(len=7)"
        in (on_rank(make(), 1, world_size).explain())
    )
    assert shares(make, world_size, policy="file") == got


def test_names_opened_by_an_io_reader_are_split_by_file(tmp_path):
    names = tp.from_tensor_slices(write_tfrecords(tmp_path, 5)).shuffle(5)
    got = shares(lambda: tp.TFRecordDataset(names), 2)
    once_each(got, records(5))
    assert [len(files) for files in whole_files(got)] == [
        3,
        2,
    ]  # no file left out to make the shares equal
    assert (
        "keeps one file in 2 of shuffle(buffer_size=5"
        in on_rank(tp.TFRecordDataset(names), 0, 2).explain()
    )


def test_ranks_times_workers_read_each_tfrecord_file_once(tmp_path):
    paths = write_tfrecords(tmp_path, 12, per_file=2)
    per_share = []
    for rank in range(2):
        for worker in range(3):
            ds = on_rank(tp.TFRecordDataset(paths, num_parallel_reads=2), rank, 2)
            with as_torch_worker(worker, 3):
                per_share.append([number(x) for x in ds])
    once_each(per_share, records(12, per_file=2))
    assert [len(files) for files in whole_files(per_share)] == [2] * 6


def test_with_torch_distributed_a_tfrecord_list_is_split_once(tmp_path, as_torch_distributed):
    paths = write_tfrecords(tmp_path, 6)
    got = []
    for rank in range(3):
        as_torch_distributed(rank, 3)
        ds = tp.TFRecordDataset(paths).with_options(
            tp.Options(distribute=tp.DistributeOptions(uneven="allow"))
        )
        got.append([number(x) for x in ds])
    once_each(got, records(6))
    off = tp.TFRecordDataset(paths).with_options(
        tp.Options(distribute=tp.DistributeOptions(policy="off"))
    )
    assert sorted(number(x) for x in off) == records(6)  # every rank reads every file


# -- WebDataset shards ----------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("num_parallel_reads", [None, 2])
def test_webdataset_shards_give_every_sample_to_one_rank(tmp_path, world_size, num_parallel_reads):
    urls = write_shards(tmp_path, 6)

    def make():
        return tp.from_webdataset(urls, shardshuffle=True, num_parallel_reads=num_parallel_reads)

    got = shares(make, world_size)
    once_each(got, records(6))
    assert [len(files) for files in whole_files(got)] == [6 // world_size] * world_size
    text = on_rank(make(), 1, world_size).explain()
    assert (
        f"distribute: rank 1 of {world_size} keeps one file in {world_size} of shuffle(buffer_size=6"
        in text
    )
    # the pipeline seed shuffles the shards all ranks split
    assert got != shares(make, world_size, seed=8)


def test_ranks_times_workers_read_each_shard_once(tmp_path, as_torch_distributed):
    urls = write_shards(tmp_path, 8)
    options = tp.Options(seed=7, distribute=tp.DistributeOptions(uneven="allow"))
    per_share = []
    for rank in range(2):
        as_torch_distributed(rank, 2)
        for worker in range(2):
            with as_torch_worker(worker, 2):
                per_share.append(
                    [
                        number(x)
                        for x in tp.from_webdataset(urls, shardshuffle=True).with_options(options)
                    ]
                )
    once_each(per_share, records(8))
    assert [len(files) for files in whole_files(per_share)] == [2] * 4


def test_with_torch_distributed_the_shards_are_split_once(tmp_path, as_torch_distributed):
    urls = write_shards(tmp_path, 6)

    def make(**distribute):
        options = tp.DistributeOptions(uneven="allow", **distribute)
        return tp.from_webdataset(urls, shardshuffle=True).with_options(
            tp.Options(seed=3, distribute=options)
        )

    got = []
    for rank in range(2):
        as_torch_distributed(rank, 2)
        got.append([number(x) for x in make()])
    once_each(got, records(6))
    # every rank reads every shard
    assert sorted(number(x) for x in make(policy="off")) == records(6)
    as_torch_distributed(0, 2)  # the rank and world size given win over torch.distributed's
    given = [[number(x) for x in make(rank=rank, world_size=3)] for rank in range(3)]
    once_each(given, records(6))
    assert [len(files) for files in whole_files(given)] == [2, 2, 2]


def test_policies_and_split_by_rank_false_over_shards(tmp_path):
    urls = write_shards(tmp_path, 4)
    whole = shares(lambda: tp.from_webdataset(urls, split_by_rank=False), 2)
    assert whole[0] == whole[1] == records(4)  # every rank reads every shard
    assert (
        "not split (rank 0 of 2 gets every element)"
        in on_rank(tp.from_webdataset(urls, split_by_rank=False), 0, 2).explain()
    )
    per_worker = []
    for worker in range(2):
        with as_torch_worker(worker, 2):  # a rank's torch workers still split what it reads
            per_worker.append(
                [number(x) for x in on_rank(tp.from_webdataset(urls, split_by_rank=False), 1, 2)]
            )
    once_each(per_worker, records(4))
    filed = shares(lambda: tp.from_webdataset(urls, split_by_rank=False), 2, policy="file")
    once_each(filed, records(4))  # an explicit policy wins
    by_element = shares(lambda: tp.from_webdataset(urls), 2, policy="data")
    once_each(by_element, records(4))
    assert [{x // 100 for x in share} for share in by_element] == [
        set(range(4))
    ] * 2  # samples of every shard
    assert shares(lambda: tp.from_webdataset(urls), 2, policy="off") == [records(4)] * 2
    # 4 shards for 8 ranks: auto splits the samples
    few = shares(lambda: tp.from_webdataset(urls), 8)
    once_each(few, records(4))
    with pytest.raises(ValueError, match="4 files for 8 ranks x 1 workers"):
        iter(on_rank(tp.from_webdataset(urls), 0, 8, policy="file"))


def test_split_files_puts_the_split_where_it_is(tmp_path):
    paths = write_tfrecords(tmp_path, 6)

    def make():  # ops of one's own on the names, then the split: the names split are the mapped ones
        names = tp.io.split_files(
            tp.from_tensor_slices(paths).map(lambda p: p).shuffle(6), shuffled=True
        )
        return names.interleave(tp.TFRecordDataset, cycle_length=2)

    got = shares(make, 3)
    once_each(got, records(6))
    whole_files(got)
    assert "keeps one file in 3 of shuffle(buffer_size=6" in on_rank(make(), 0, 3).explain()
    with as_torch_worker(0, 2), pytest.raises(RuntimeError, match="tp.Options\\(seed=...\\)"):
        iter(
            make().with_options(
                tp.Options(distribute=tp.DistributeOptions(rank=0, world_size=2, uneven="allow"))
            )
        )
    assert sorted(number(x) for x in make()) == records(6)  # one process: every file


def test_a_rank_resumes_its_own_files_and_refuses_another_ranks(tmp_path):
    urls = write_shards(tmp_path, 4)
    ds = [on_rank(tp.from_webdataset(urls, shardshuffle=True), rank, 2) for rank in range(2)]
    assert_checkpoint_roundtrip(ds[1])
    it = iter(ds[1])
    next(it)
    with pytest.raises(tp.CheckpointError, match="rank 1 of 2's and this is rank 0 of 2"):
        iter(ds[0]).load_state_dict(it.state_dict())


def test_share_of_files_is_the_file_split_for_any_reader():
    files = [f"f{i}" for i in range(7)]
    split = [
        share_of_files(files, Share(2, rank, 2, worker)) for rank in range(2) for worker in range(2)
    ]
    assert split == [["f0", "f4"], ["f2", "f6"], ["f1", "f5"], ["f3"]]
    assert share_of_files(files) == files  # no ranks, no workers here
    with pytest.raises(ValueError, match="7 files for 4 ranks x 2 workers"):
        share_of_files(files, Share(4, 0, 2, 0))

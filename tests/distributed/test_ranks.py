"""A pipeline split between ranks, each rank simulated in this process with
``DistributeOptions(rank=..., world_size=...)`` (tests/distributed/test_gloo_ranks.py runs real ranks).

What is checked: every element reaches one rank for each policy, with shuffles; equal lengths
(drop, pad) as DistributedSampler makes them; rank x torch-worker splits; checkpoints per rank;
global batches; explain(); the errors (resharding: test_reshard.py; who a process is: test_context.py).
"""

import collections

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import torchpipe as tp
from torchpipe.testing import as_torch_worker, assert_checkpoint_roundtrip


class Numbers(torch.utils.data.Dataset):
    """``i`` at index ``i``, remembering the indices read."""

    def __init__(self, n):
        self.n = n
        self.reads = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads.append(i)
        return i


def on_rank(ds, rank, world_size, seed=7, **distribute):
    return ds.with_options(
        tp.Options(
            seed=seed,
            distribute=tp.DistributeOptions(rank=rank, world_size=world_size, **distribute),
        )
    )


def flat(elements):
    return [int(x) for e in elements for x in (e.tolist() if torch.is_tensor(e) else [e])]


def shares(make, world_size, **distribute):
    return [flat(on_rank(make(), rank, world_size, **distribute)) for rank in range(world_size)]


def once_each(shares_, expected):
    assert collections.Counter(x for share in shares_ for x in share) == collections.Counter(
        expected
    )


def write_files(tmp_path, count, per_file=3):
    for f in range(count):
        (tmp_path / f"{f:02d}.txt").write_text("".join(f"{f * 100 + i}\n" for i in range(per_file)))
    return str(tmp_path / "*.txt")


def file_number(path):
    return int(path[-6:-4])


def read_lines(path):
    with open(path) as f:
        return tp.from_tensor_slices([int(line) for line in f])


# -- every element once, each policy -----------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_data_policy_splits_the_shuffled_order_and_reads_only_the_share(world_size):
    sources = []

    def make():
        sources.append(Numbers(30))
        return tp.from_dataset(sources[-1]).shuffle(30).map(lambda x: x + 1).batch(4)

    got = shares(make, world_size)
    once_each(got, range(1, 31))
    for share, source in zip(got, sources):
        # dataset[i] read for its share only
        assert sorted(source.reads) == sorted(x - 1 for x in share)
    assert got != shares(make, world_size, seed=8)  # the seed decides the shuffle all ranks split


@pytest.mark.parametrize("world_size", [2, 3])
def test_file_policy_gives_each_rank_its_own_files(tmp_path, world_size):
    pattern = write_files(tmp_path, 6)

    def make():
        return (
            tp.list_files(pattern, shuffle=True).interleave(read_lines, cycle_length=2).shuffle(5)
        )

    got = shares(make, world_size, uneven="allow")
    once_each(got, [f * 100 + i for f in range(6) for i in range(3)])
    files_of = [{x // 100 for x in share} for share in got]
    assert all(len(files) == 6 // world_size for files in files_of)  # whole files, each on one rank
    text = on_rank(make(), 1, world_size).explain()
    assert (
        f"distribute: rank 1 of {world_size} keeps one file in {world_size} of shuffle(buffer_size=6"
        in text
    )


def test_output_policy_runs_the_whole_pipeline_on_each_rank():
    def make():
        return tp.zip(tp.range(20).shuffle(20), tp.range(100, 120)).map(lambda a, b: a * 1000 + b)

    got = shares(make, 2)
    once_each([[x % 1000 for x in share] for share in got], range(100, 120))
    once_each([[x // 1000 for x in share] for share in got], range(20))  # the ranks shuffled alike
    assert "runs the whole pipeline (2 sources)" in on_rank(make(), 0, 2).explain()


def test_ops_above_the_shard_draw_differently_on_each_rank():
    # below the shard: one shuffle for all ranks; above it (here a shuffle after a map), each
    # rank's own: the ranks' shares are not permuted alike
    def make():
        return tp.range(40).map(lambda x: x).shuffle(20)

    first, second = shares(make, 2)
    assert [x // 2 for x in first] != [x // 2 for x in second]
    once_each([first, second], range(40))


# -- equal lengths -------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, n", [(2, 9), (3, 10), (4, 2), (3, 11)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_equal_lengths_are_distributed_samplers(world_size, n, drop_last):
    uneven = "drop" if drop_last else "pad"
    got = shares(lambda: tp.from_dataset(Numbers(n)), world_size, uneven=uneven)
    for rank, share in enumerate(got):
        sampler = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last
        )
        assert share == list(sampler)


def test_uneven_allow_leaves_the_lengths_alone():
    got = shares(lambda: tp.range(11).shuffle(11), 3, uneven="allow")
    assert [len(share) for share in got] == [4, 4, 3]
    once_each(got, range(11))


def test_known_lengths_that_differ_are_cut_to_the_shortest_or_padded_to_the_longest(tmp_path):
    pattern = write_files(tmp_path, 5)

    def make():  # files are split whole: 3 on rank 0, 2 on rank 1; a file is one element here
        return tp.list_files(pattern).map(file_number)

    assert [len(s) for s in shares(make, 2, uneven="drop")] == [2, 2]
    padded = [on_rank(make(), rank, 2, uneven="pad") for rank in range(2)]
    assert [len(list(ds)) for ds in padded] == [3, 3] and len(padded[1]) == 3
    assert list(padded[1])[2] == list(padded[1])[0]  # noqa: RUF015 - padded from the start of its pass


def test_equal_lengths_resume_exactly(tmp_path):
    for uneven in ("drop", "pad"):
        assert_checkpoint_roundtrip(
            on_rank(tp.list_files(write_files(tmp_path, 5)), 1, 2, uneven=uneven)
        )
        assert_checkpoint_roundtrip(
            on_rank(tp.from_dataset(Numbers(11)).shuffle(4).batch(2), 2, 3, uneven=uneven)
        )


# -- ranks x torch DataLoader workers --------------------------------------------------------------
def test_ranks_times_workers_split_once_and_a_rank_keeps_its_share():
    def make():
        return tp.from_dataset(Numbers(24)).shuffle(24).map(lambda x: x)

    without = shares(make, 2)
    with_workers = []
    for rank in range(2):
        per_worker = []
        for worker in range(3):
            ds = on_rank(make(), rank, 2)  # each worker its own copy, in the same epoch
            with as_torch_worker(worker, 3):
                per_worker.append(flat(ds))
                assert f"[rank {rank} of 2 x torch worker {worker} of 3]" in ds.explain()
        with_workers.append(per_worker)
    once_each([share for rank in with_workers for share in rank], range(24))
    for rank in range(2):
        assert sorted(x for w in with_workers[rank] for x in w) == sorted(without[rank])


def test_in_a_torch_worker_ranks_must_share_a_seed_given_to_them():
    ds = (
        tp.range(10)
        .shuffle(10)
        .with_options(tp.Options(distribute=tp.DistributeOptions(rank=0, world_size=2)))
    )
    with as_torch_worker(0, 2), pytest.raises(RuntimeError, match="tp.Options\\(seed=...\\)"):
        iter(ds)
    plain = (
        tp.range(10)
        .map(lambda x: x)
        .with_options(tp.Options(distribute=tp.DistributeOptions(rank=0, world_size=2)))
    )
    with as_torch_worker(1, 2):
        assert list(plain) == [2, 6]  # nothing random below the shard: no shared seed needed


# -- checkpoints and resharding ------------------------------------------------------------------
def test_each_rank_resumes_its_own_state_and_refuses_another_ranks():
    ds = [
        on_rank(tp.from_dataset(Numbers(20)).shuffle(7).map(lambda x: x * 2, 2).batch(3), r, 2)
        for r in range(2)
    ]
    assert_checkpoint_roundtrip(ds[1])
    it = iter(ds[0])
    next(it)
    with pytest.raises(
        tp.CheckpointError, match="rank 0 of 2's and this is rank 1 of 2.*reshard_states"
    ):
        iter(ds[1]).load_state_dict(it.state_dict())


def test_global_batch_sizes_are_split_between_ranks():
    def make():
        return tp.from_dataset(Numbers(24)).batch(8)

    got = [list(on_rank(make(), r, 4, global_batch=True)) for r in range(4)]
    assert all(batch.shape == (2,) for share in got for batch in share)
    for step in range(3):  # a step's batches across ranks make up the global batch
        assert sorted(x for share in got for x in share[step].tolist()) == list(
            range(8 * step, 8 * step + 8)
        )
    assert (
        "global batch sizes: batch(batch_size=8, drop_remainder=False) -> 2 a rank"
        in on_rank(make(), 0, 4, global_batch=True).explain()
    )
    with pytest.raises(ValueError, match="global batch size 8 must divide by 3"):
        iter(on_rank(make(), 0, 3, global_batch=True))
    with pytest.raises(ValueError, match="no batch, padded_batch or rebatch"):
        iter(on_rank(tp.range(8), 0, 2, global_batch=True))


def test_global_batches_at_the_output_are_split_too():
    make = lambda: tp.zip(tp.range(16), tp.range(16)).map(lambda a, b: a).batch(4)  # noqa: E731
    got = [list(on_rank(make(), r, 2, global_batch=True)) for r in range(2)]
    assert [b.tolist() for b in got[0]] == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert [b.tolist() for b in got[1]] == [[2, 3], [6, 7], [10, 11], [14, 15]]


# -- choosing, explaining, refusing ---------------------------------------------------------------
def test_policies_choose_where_the_shard_goes(tmp_path):
    pattern = write_files(tmp_path, 3)
    files = tp.list_files(pattern).interleave(read_lines)
    assert "keeps one file in 2" in on_rank(files, 0, 2).explain()
    assert (
        "runs the whole pipeline (files, split by element with policy='data')"
        in on_rank(files, 0, 2, policy="data", uneven="allow").explain()
    )
    fallback = on_rank(files, 0, 4, uneven="allow")  # 3 files for 4 ranks: auto splits elements
    assert "runs the whole pipeline (3 files, fewer than 4 ranks x workers)" in fallback.explain()
    once_each([flat(on_rank(files, r, 4, uneven="allow")) for r in range(4)], flat(files))
    with pytest.raises(ValueError, match="3 files for 4 ranks x 1 workers"):
        iter(on_rank(files, 0, 4, policy="file"))
    with pytest.raises(ValueError, match="does not start from tp.list_files"):
        iter(on_rank(tp.range(8), 0, 2, policy="file"))
    assert flat(on_rank(tp.range(5), 1, 2, policy="off")) == [0, 1, 2, 3, 4]


def test_a_pipeline_that_shards_itself_is_not_split_again():
    ds = tp.range(12).shuffle(12).shard(2, 1)
    assert (
        "the pipeline shards itself: not split again" in on_rank(ds, 1, 2, uneven="allow").explain()
    )
    assert len(flat(on_rank(ds, 1, 2, uneven="allow"))) == 6
    per_worker = []
    for rank in range(2):
        for worker in range(3):
            with as_torch_worker(worker, 3):  # but a rank's torch workers split what it reads
                per_worker.append(
                    flat(on_rank(tp.range(12).shuffle(12).shard(2, rank), rank, 2, uneven="allow"))
                )
    once_each(per_worker, range(12))


def test_explain_says_where_the_shard_would_go_and_went():
    ds = tp.from_dataset(Numbers(10)).shuffle(10).map(lambda x: x)
    assert (
        "On several ranks: each rank keeps one element in world_size of shuffle(buffer_size=10, seed=None, "
        "reshuffle_each_iteration=True) over from_dataset(dataset='Numbers', len=10)"
    ) in ds.explain()
    text = on_rank(ds, 1, 3).explain()
    assert "distribute(level='data', uneven='drop') [rank 1 of 3]" in text
    assert "Cardinality: 10 (this rank's share: 3)" in text and "On several ranks" not in text
    assert len(on_rank(ds, 1, 3)) == 3


def test_without_torch_distributed_ranks_of_unknown_length_cannot_agree():
    ds = on_rank(tp.range(10).filter(lambda x: x % 3 > 0), 0, 2)
    assert "the ranks agree at each element" in ds.explain()
    with pytest.raises(RuntimeError, match="must agree where it ends.*uneven='allow'"):
        iter(ds)
    assert flat(on_rank(tp.range(10).filter(lambda x: x % 3 > 0), 0, 2, uneven="allow")) == [
        2,
        4,
        8,
    ]
    no_seed = (
        tp.range(10)
        .shuffle(10)
        .with_options(tp.Options(distribute=tp.DistributeOptions(rank=0, world_size=2)))
    )
    with pytest.raises(
        RuntimeError, match="torch.distributed is not initialized.*tp.Options\\(seed=...\\)"
    ):
        iter(no_seed)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"policy": "files"}, ValueError),
        ({"uneven": "trim"}, ValueError),
        ({"rank": 1}, ValueError),
        ({"rank": 2, "world_size": 2}, ValueError),
        ({"rank": 0, "world_size": 0}, ValueError),
        ({"rank": "0", "world_size": 2}, TypeError),
        ({"global_batch": 1}, TypeError),
    ],
)
def test_bad_distribute_options(kwargs, error):
    with pytest.raises(error):
        tp.DistributeOptions(**kwargs)
    with pytest.raises(TypeError, match="tp.DistributeOptions"):
        tp.Options(distribute={"policy": "data"})

"""What each rank does in the multi-process tests (tests/distributed/test_gloo_ranks.py), run by
``tests/cluster.py`` in every rank's process. Results go back pickled: plain ints and lists."""

from __future__ import annotations

import glob
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

import torchpipe as tp


class Numbers(torch.utils.data.Dataset):
    """``i`` at index ``i``, remembering which indices this process read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.reads.append(i)
        return i


def _lines(path: str) -> tp.Dataset:
    with open(path) as f:
        return tp.from_tensor_slices([int(line) for line in f])


def _odd(x: int) -> bool:
    return x % 3 != 0


def _every(x: int) -> bool:
    return x >= 0


def _cls(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def pipeline(kind: str, n: int, files: str = "", **distribute: Any) -> tp.Dataset:
    """The pipelines the tests split, none with a seed of its own (ranks must share one)."""
    options = (
        tp.Options(distribute=tp.DistributeOptions(**distribute)) if distribute else tp.Options()
    )
    if kind == "data":
        ds = tp.from_dataset(Numbers(n)).shuffle(n).map(lambda x: x * 10, num_parallel_calls=2)
    elif kind == "file":
        ds = (
            tp.list_files(os.path.join(files, "*.txt"), shuffle=True)
            .interleave(_lines, cycle_length=2)
            .shuffle(8)
        )
    elif kind == "output":
        ds = tp.zip(tp.range(n).shuffle(n), tp.range(n)).map(lambda a, b: a * 1000 + b)
    elif kind == "filter":
        ds = tp.range(n).shuffle(n).filter(_odd)
    elif kind == "tfrecord":  # a file list of torchpipe.io's reader, interleaved
        ds = tp.TFRecordDataset(
            sorted(glob.glob(os.path.join(files, "*.tfrecord"))), num_parallel_reads=2
        ).map(int)
        ds = ds.shuffle(8)
    elif kind == "webdataset":  # shards shuffled with the pipeline seed: rank 0's, broadcast
        ds = tp.from_webdataset(
            os.path.join(files, "shard-{000000..000005}.tar"), shardshuffle=True
        ).map(_cls)
    elif kind == "manual":
        ds = tp.range(n).shuffle(n).shard(dist.get_world_size(), dist.get_rank())
    else:
        raise ValueError(kind)
    return ds.with_options(options)


def elements(
    kind: str, n: int, files: str = "", epochs: int = 1, **distribute: Any
) -> list[list[int]]:
    """Each epoch's elements on this rank."""
    ds = pipeline(kind, n, files, **distribute)
    return [[int(x) for x in ds] for _ in range(epochs)]


def elements_and_seeds(
    kind: str, n: int, files: str = "", epochs: int = 1
) -> tuple[list[list[int]], list[int]]:
    """Each epoch's elements on this rank, and the seed each pass drew (its checkpoint's)."""
    ds = pipeline(kind, n, files)
    shares, seeds = [], []
    for _ in range(epochs):
        with iter(ds) as it:
            seeds.append(it.state_dict()["seed"])
            shares.append([int(x) for x in it])
    return shares, seeds


def steps(kind: str, n: int, batch: int, **distribute: Any) -> list[list[int]]:
    """The batches this rank's pass yields (as lists), through tp.DataLoader."""
    ds = pipeline(kind, n, **distribute).batch(batch)
    return [b.tolist() for b in tp.DataLoader(ds, batch_size=None)]


def reads(n: int) -> tuple[list[int], list[int]]:
    """What a from_dataset pipeline yields on this rank, and which indices it read."""
    source = Numbers(n)
    ds = tp.from_dataset(source).shuffle(n).map(lambda x: x)
    return [int(x) for x in ds], sorted(source.reads)


def explain(kind: str, n: int, files: str = "", **distribute: Any) -> str:
    return pipeline(kind, n, files, **distribute).explain()


def states_after(k: int, n: int, batch: int) -> tuple[list[list[int]], bytes]:
    """The first ``k`` batches of a pass and the state after them (pickled)."""
    it = iter(_resharded(n, batch))
    head = [next(it).tolist() for _ in range(k)]
    state = pickle.dumps(it.state_dict())
    it.close()
    return head, state


def resume(state: bytes, n: int, batch: int) -> list[list[int]]:
    """The rest of a pass resumed from ``state``."""
    it = iter(_resharded(n, batch))
    it.load_state_dict(pickle.loads(state))
    return [b.tolist() for b in it]


def _resharded(n: int, batch: int) -> tp.Dataset:
    return (
        tp.from_dataset(Numbers(n))
        .shuffle(n)
        .map(lambda x: x + 1, num_parallel_calls=2)
        .batch(batch)
    )


def resume_uneven(k: int, n: int) -> tuple[list[int], list[int]]:
    """A pass of unknown length on each rank, and the same pass resumed after ``k`` elements."""

    def make() -> tp.Dataset:  # a new Dataset for each pass: all three in epoch 0
        return pipeline("filter", n).with_options(tp.Options(seed=4))

    whole = [int(x) for x in make()]
    it = iter(make())
    head = [int(next(it)) for _ in range(k)]
    state = pickle.loads(pickle.dumps(it.state_dict()))
    it.close()
    resumed = iter(make())
    resumed.load_state_dict(state)
    return whole, head + [int(x) for x in resumed]


def loader_parity(n: int, batch: int, drop_last: bool, workers: int) -> bool:
    """tp.DataLoader with DistributedSampler gives torch's batches, epoch after epoch."""
    ours, theirs = [], []
    for loader_type, out in ((tp.DataLoader, ours), (torch.utils.data.DataLoader, theirs)):
        sampler = torch.utils.data.distributed.DistributedSampler(
            Numbers(n), shuffle=True, seed=3, drop_last=drop_last
        )
        kwargs = {"num_workers": workers} if loader_type is tp.DataLoader else {}
        loader = loader_type(Numbers(n), batch_size=batch, sampler=sampler, **kwargs)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            out.append([b.tolist() for b in loader])
    return ours == theirs and len(ours[0]) > 0


def torch_workers(n: int, num_workers: int, seed: int) -> list[int]:
    """A pipeline as the dataset of torch's own DataLoader with workers, on this rank."""
    ds = tp.from_dataset(Numbers(n)).shuffle(n).map(lambda x: x).with_options(tp.Options(seed=seed))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    return [int(x) for x in loader]


def train_ddp(n: int, batch: int, use_loader: bool) -> tuple[int, list[float]]:
    """A few DDP steps of a small model; the step count and the weights after them."""
    torch.manual_seed(dist.get_rank())  # ranks start from different weights: DDP makes them one
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = tp.from_tensor_slices(
        (
            torch.randn(n, 4, generator=torch.Generator().manual_seed(0)),
            torch.randn(n, 1, generator=torch.Generator().manual_seed(1)),
        )
    )
    if use_loader:
        batches = tp.DataLoader(data.shuffle(n), batch_size=batch)
    else:
        batches = data.shuffle(n).batch(batch).prefetch(2)
    count = 0
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        count += 1
    return count, [round(float(v), 6) for v in model.module.weight.flatten()]


def break_early(n: int, at: int, rounds: int) -> list[int]:
    """Passes of unknown length left after ``at`` elements, then one to the end (a closed pass's
    agreement must not disturb the next). The filter keeps every element: each rank's share is
    then ``n / 2`` whatever the pass's seed, so a pass cut short shows."""
    ds = tp.range(n).shuffle(n).filter(_every)
    for _ in range(rounds):
        it = iter(ds)
        for _ in range(at):
            next(it)
        it.close()
    return [int(x) for x in ds]


def one_rank_leaves(n: int) -> str:
    """Rank 0 leaves its pass after one element; rank 1 goes on: it must fail, not wait forever."""
    ds = pipeline("filter", n).with_options(tp.Options(stall_timeout=3))
    it = iter(ds)
    next(it)
    if dist.get_rank() == 0:
        it.close()
        return "left"
    try:
        list(it)
    except RuntimeError as e:
        return f"error: {e}"
    return "no error"


def _tenfold(x: int) -> int:
    return 10 * x


class SplitByHand(torch.utils.data.IterableDataset):
    """A pipeline the user's ``__iter__`` splits by hand, as torch's docs show: by rank
    (``shard(world_size, rank)``), by torch DataLoader worker (``shard(num_workers, id)``), or
    both (``tp.distributed.share_of_files``)."""

    def __init__(self, n: int, by: str) -> None:
        self.n, self.by = n, by
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def __iter__(self) -> Any:
        ds = tp.range(self.n).map(_tenfold)
        # the others' lengths are not known
        allow = tp.Options(distribute=tp.DistributeOptions(uneven="allow"))
        if self.by == "rank":
            ds = ds.shard(self.world_size, self.rank).with_options(allow)
        elif self.by == "files":  # ranks x workers, by tp.distributed.share_of_files
            ds = tp.from_tensor_slices(tp.distributed.share_of_files(list(range(self.n)))).map(
                _tenfold
            )
            ds = ds.with_options(allow)
        else:
            info = torch.utils.data.get_worker_info()
            ds = ds.shard(info.num_workers, info.id) if info is not None else ds
        return iter(ds)


def split_by_hand(n: int, by: str, num_workers: int) -> list[int]:
    """What torch's DataLoader over :class:`SplitByHand` gives this rank."""
    loader = torch.utils.data.DataLoader(
        SplitByHand(n, by), batch_size=None, num_workers=num_workers
    )
    return [int(x) for x in loader]

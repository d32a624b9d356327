"""torchpipe.DataLoader against torch.utils.data.DataLoader itself."""

import os
import subprocess
import sys
import time
import typing
import warnings

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import IterableDataset, TensorDataset, get_worker_info

import torchpipe as tp
from torchpipe.testing import assert_same_elements

DATA = TensorDataset(torch.arange(23.0), torch.arange(23) % 3)


def both(**kwargs):
    """The same loader from torch and torchpipe, each with its own generator seeded alike."""
    loaders = []
    for cls in (TorchLoader, tp.DataLoader):
        args = dict(kwargs)
        if "generator" in args:
            args["generator"] = torch.Generator().manual_seed(args["generator"])
        if callable(args.get("sampler")):
            args["sampler"] = args["sampler"]()
        loaders.append(cls(args.pop("dataset", DATA), **args))
    return loaders


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=4, shuffle=True, generator=1),
        dict(batch_size=4, shuffle=True, drop_last=True, generator=2),
        dict(batch_size=None, shuffle=True, generator=3),
        dict(
            batch_size=5,
            sampler=lambda: torch.utils.data.SubsetRandomSampler(
                range(0, 23, 2), generator=torch.Generator().manual_seed(4)
            ),
        ),
        dict(batch_sampler=[[0, 1], [5, 3, 2], [22]]),
        dict(batch_size=3, collate_fn=lambda items: sum(float(x) for x, _ in items)),
    ],
)
def test_same_batches_every_epoch(num_workers, kwargs):
    theirs, ours = both(num_workers=num_workers, **kwargs)
    assert len(theirs) == len(ours)
    for _ in range(2):
        assert_same_elements(list(ours), list(theirs))


def test_generator_is_consumed_like_torch():
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    list(TorchLoader(DATA, batch_size=4, shuffle=True, num_workers=2, generator=g1))
    list(tp.DataLoader(DATA, batch_size=4, shuffle=True, num_workers=2, generator=g2))
    assert torch.equal(g1.get_state(), g2.get_state())


def test_distributed_sampler_with_set_epoch():
    samplers = [
        torch.utils.data.DistributedSampler(DATA, num_replicas=2, rank=1, seed=3) for _ in range(2)
    ]
    loaders = [
        cls(DATA, batch_size=3, sampler=s, num_workers=2)
        for cls, s in zip((TorchLoader, tp.DataLoader), samplers)
    ]
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        assert_same_elements(list(loaders[1]), list(loaders[0]))


class WithGetitems(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        raise AssertionError("__getitems__ should be used")

    def __getitems__(self, indices):
        return [torch.tensor(i) for i in indices]


@pytest.mark.parametrize("num_workers", [0, 2, "auto"])
def test_getitems_is_used(num_workers):
    assert [
        b.tolist() for b in tp.DataLoader(WithGetitems(), batch_size=4, num_workers=num_workers)
    ] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_workers=-1),
        dict(timeout=-1),
        dict(prefetch_factor=2),
        dict(persistent_workers=True),
        dict(sampler=[0, 1], shuffle=True),
        dict(batch_sampler=[[0]], batch_size=2),
        dict(batch_sampler=[[0]], drop_last=True),
        dict(batch_size=None, drop_last=True),
        dict(num_workers=2, prefetch_factor=-1),
    ],
)
def test_same_errors_for_the_same_mistakes(kwargs):
    with pytest.raises(ValueError) as theirs:
        TorchLoader(DATA, **kwargs)
    with pytest.raises(ValueError) as ours:
        tp.DataLoader(DATA, **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_attributes_are_read_only_after_init():
    loader = tp.DataLoader(DATA, batch_size=4)
    for name, value in [
        ("batch_size", 2),
        ("sampler", None),
        ("drop_last", True),
        ("dataset", DATA),
    ]:
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, value)
    assert isinstance(loader, TorchLoader) and loader.batch_size == 4 and len(loader) == 6


class Stream(IterableDataset):
    """Each worker yields its own share, tagged with what get_worker_info() says."""

    def __init__(self, n=10):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, self.n + wid, workers):  # uneven on purpose
            yield {"i": i, "worker": wid, "workers": workers, "noise": float(torch.rand(()))}


@pytest.mark.parametrize("batch_size", [None, 3])
def test_iterable_dataset_replicas_order_and_worker_info(batch_size):
    theirs, ours = both(dataset=Stream(), num_workers=2, batch_size=batch_size, generator=7)
    assert_same_elements(list(ours), list(theirs))  # same order, same per-worker random seeds


def init_marker(worker_id):
    torch.utils.data.get_worker_info().dataset.marks.append(worker_id)


class Marked(torch.utils.data.Dataset):
    def __init__(self):
        self.marks = []

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return (os.getpid(), tuple(self.marks), get_worker_info().seed)


def test_worker_init_fn_runs_once_per_worker_and_persistent_workers_stay():
    loader = tp.DataLoader(
        Marked(),
        batch_size=2,
        num_workers=2,
        worker_init_fn=init_marker,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    first = list(loader)
    second = list(loader)
    pids = {int(p) for b in first for p in b[0]}
    assert len(pids) == 2 and pids == {int(p) for b in second for p in b[0]}
    assert all(marks in ((0,), (1,)) for b in first for marks in zip(*b[1]))
    torch_first = list(
        TorchLoader(
            Marked(),
            batch_size=2,
            num_workers=2,
            worker_init_fn=init_marker,
            generator=torch.Generator().manual_seed(0),
        )
    )
    assert [b[2].tolist() for b in first] == [
        b[2].tolist() for b in torch_first
    ]  # same worker seeds


class Slow(torch.utils.data.Dataset):
    def __init__(self, delay, slow_index=None, length=6):
        self.delay, self.slow_index, self.length = delay, slow_index, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.slow_index is None or i == self.slow_index:
            time.sleep(self.delay)
        return i


def test_timeout_raises_runtime_error():
    with pytest.raises(RuntimeError, match="timed out after 0.2 seconds"):
        list(tp.DataLoader(Slow(2.0), num_workers=1, timeout=0.2))


def test_in_order_false_delivers_as_completed():
    out = [int(b) for b in tp.DataLoader(Slow(1.0, slow_index=0), num_workers=2, in_order=False)]
    assert sorted(out) == list(range(6)) and out[0] != 0
    assert [int(b) for b in tp.DataLoader(Slow(0.2, slow_index=0), num_workers=2)] == list(range(6))


def test_in_order_false_sends_work_past_a_stalled_worker():
    # torch gives a free worker the next batch; round-robin would queue half of them behind the stall
    out = [
        int(b)
        for b in tp.DataLoader(Slow(1.5, slow_index=0, length=40), num_workers=2, in_order=False)
    ]
    assert sorted(out) == list(range(40)) and out.index(0) >= 30


class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise KeyError(f"no record {i}")
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitem_errors_keep_their_type(num_workers):
    with pytest.raises(KeyError, match="no record 2"):
        list(tp.DataLoader(Broken(), num_workers=num_workers))


def test_spawn_context_is_honoured():
    theirs, ours = both(batch_size=4, num_workers=1, multiprocessing_context="spawn")
    assert_same_elements(list(ours), list(theirs))


def test_a_global_start_method_is_honoured():
    # as torch does: set_start_method("spawn") makes the default context spawn, so torch's own workers run
    code = (
        "import multiprocessing, torch, torchpipe as tp; multiprocessing.set_start_method('spawn'); "
        "print(tp.explain(tp.DataLoader(torch.arange(4), num_workers=2)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert "torch's own iterator (a spawn/forkserver context)" in done.stdout, done.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_workers="Auto"), 'num_workers must be a non-negative int or "auto"'),
        (dict(num_workers=2, prefetch_factor=0), "prefetch_factor must be at least 1"),
        (dict(device="nonsense"), "device must be a cpu or cuda device"),
        (dict(device=5), "device must be a device name"),
    ],
)
def test_bad_new_words_fail_at_construction_with_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tp.DataLoader(DATA, **kwargs)


@pytest.mark.parametrize("dataset", [5, None, (i for i in range(3)), iter([1, 2]), {1, 2}])
def test_a_dataset_torch_cannot_index_or_iterate_is_a_type_error_at_construction(dataset):
    # torch builds these loaders and fails only when the epoch starts
    with pytest.raises(
        TypeError,
        match=r"^dataset must be a map-style dataset \(with __getitem__\) or a torch "
        f"IterableDataset, got {type(dataset).__name__}",
    ):
        tp.DataLoader(dataset)


@pytest.mark.parametrize(
    "dataset", [[1.0, 2.0, 3.0], "abc", torch.arange(3), np.arange(3), range(3), DATA]
)
def test_what_torch_takes_as_a_map_style_dataset_is_taken(dataset):
    assert_same_elements(
        tp.DataLoader(dataset, batch_size=2), list(TorchLoader(dataset, batch_size=2))
    )


@pytest.mark.parametrize("num_workers", [2.5, 2.0, 0.0, None, torch.tensor(1.0)])
def test_a_num_workers_that_is_not_an_int_is_a_type_error_at_construction(num_workers):
    with pytest.raises(TypeError, match=r'^num_workers must be a non-negative int or "auto", got '):
        tp.DataLoader(DATA, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [True, False, np.int64(1)])
def test_a_bool_or_numpy_int_num_workers_is_taken_as_torch_takes_it(num_workers):
    # torch runs True as one worker
    loaders = both(batch_size=5, num_workers=num_workers)
    assert_same_elements(loaders[1], list(loaders[0]))


def test_the_loader_is_generic_as_torchs():
    alias = tp.DataLoader[tuple]
    assert typing.get_origin(alias) is tp.DataLoader and typing.get_args(alias) == (tuple,)
    assert typing.get_origin(TorchLoader[tuple]) is TorchLoader  # the same as torch's own
    loader = alias(DATA, batch_size=4)
    assert type(loader) is tp.DataLoader
    assert_same_elements(list(loader), list(TorchLoader(DATA, batch_size=4)))

    class Batches(tp.DataLoader[tuple]):  # a typed subclass, as users write for torch's
        pass

    assert_same_elements(list(Batches(DATA, batch_size=4)), list(TorchLoader(DATA, batch_size=4)))


def test_auto_workers_and_cpu_device():
    loader = tp.DataLoader(DATA, batch_size=4, num_workers="auto", device="cpu")
    assert loader.num_workers >= 1 and loader.device == torch.device("cpu")
    assert_same_elements(list(loader), list(TorchLoader(DATA, batch_size=4)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_without_cuda_pinning_is_skipped_and_cuda_device_is_a_clear_error():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(tp.DataLoader(DATA, batch_size=8, pin_memory=True, num_workers=2))
    assert len(batches) == 3 and any("pin_memory" in str(w.message) for w in caught)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        tp.DataLoader(DATA, device="cuda")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_in_a_new_loader(num_workers):
    def make():
        return tp.DataLoader(
            DATA,
            batch_size=3,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(11),
        )

    loader = make()
    list(loader)  # a first epoch, so the state is from the second
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    fresh = make()
    fresh.load_state_dict(state)
    assert_same_elements(list(fresh), rest)
    assert len(head) + len(rest) == len(loader)
    with pytest.raises(ValueError, match="not a torchpipe DataLoader state"):
        fresh.load_state_dict({})


def _state_of(loader, batches=3):
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    "other, differs",
    [
        (dict(batch_size=4), "batch_size: the state's 3, this loader's 4"),
        (
            dict(shuffle=False),
            "sampler: the state's 'RandomSampler', this loader's 'SequentialSampler'",
        ),
        (
            dict(dataset=TensorDataset(torch.arange(10.0))),
            "length: the state's 23, this loader's 10",
        ),
        (dict(drop_last=True), "drop_last: the state's False, this loader's True"),
    ],
)
def test_a_state_does_not_load_into_a_loader_that_makes_other_batches(other, differs):
    kwargs = dict(dataset=DATA, batch_size=3, shuffle=True)
    state = _state_of(tp.DataLoader(**kwargs))
    with pytest.raises(tp.CheckpointError, match=differs.replace("(", r"\(")):
        tp.DataLoader(**{**kwargs, **other}).load_state_dict(state)


@pytest.mark.parametrize(
    "garble, message",
    [
        (dict(yielded="3"), "'yielded' must be a count of batches"),
        (dict(yielded=-1), "'yielded' must be a count of batches"),
        (dict(epoch_rng=[1, 2]), "'epoch_rng' must be a generator state"),
        (dict(loader="x"), "'loader' must be a dict"),
        (dict(yielded=100), "is at batch 100, but this loader's epoch has 8 batches"),
    ],
)
def test_a_garbled_state_is_a_checkpoint_error_that_names_the_key(garble, message):
    loader = tp.DataLoader(DATA, batch_size=3)
    with pytest.raises(tp.CheckpointError, match=message):
        loader.load_state_dict({**_state_of(loader), **garble})


class Counted(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_past_the_end_of_an_unsized_epoch_is_a_checkpoint_error_not_a_stop_iteration(
    num_workers,
):
    state = _state_of(tp.DataLoader(Counted(30), batch_size=3, num_workers=num_workers), batches=6)
    del state["loader"]  # a format-1 state carries no fingerprint, and the stream has no length
    short = tp.DataLoader(Counted(6), batch_size=3, num_workers=num_workers)
    short.load_state_dict({**state, "format": 1})
    with pytest.raises(tp.CheckpointError, match="epoch ends before it"):
        iter(short)


def test_a_pipeline_as_dataset_is_not_replicated_into_workers_and_a_worker_count_warns():
    pipeline = tp.range(10).map(lambda x: x * 2, 2)
    with pytest.warns(
        UserWarning, match="num_workers=2 is not used: a tp.Dataset runs its own parallel stages"
    ) as record:
        loader = tp.DataLoader(pipeline, batch_size=4, num_workers=2)
    assert record[0].filename == __file__  # the warning points where the loader is made
    assert [b.tolist() for b in loader] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.DataLoader(pipeline, batch_size=4, num_workers="auto")  # auto: in-process is its choice


def test_persistent_workers_consume_the_generator_like_torch():
    theirs, ours = both(
        batch_size=4, shuffle=True, num_workers=2, persistent_workers=True, generator=9
    )
    for _ in range(3):
        assert_same_elements(list(ours), list(theirs))


class Counting(torch.utils.data.Dataset):
    """Records every fetch in a file (workers are other processes)."""

    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 40

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return i


def test_prefetch_factor_bounds_batches_in_flight(tmp_path):
    path = tmp_path / "fetched"
    it = iter(tp.DataLoader(Counting(str(path)), batch_size=2, num_workers=2, prefetch_factor=3))
    next(it)
    time.sleep(0.5)  # let the workers run as far ahead as they may
    fetched = len(path.read_text().split())
    assert fetched <= (3 * 2 + 1) * 2  # prefetch_factor * num_workers batches, plus the refill
    assert len(list(it)) == 19


def test_worker_batches_are_stacked_into_shared_memory_with_default_collate_semantics():
    data = TensorDataset(torch.arange(24.0).reshape(12, 2), torch.arange(12))
    theirs, ours = both(dataset=data, batch_size=5, num_workers=2)
    out = list(ours)
    assert_same_elements(out, list(theirs))
    assert type(out[0]) is list  # default_collate's list for a tuple element, unchanged
    ragged = [torch.zeros(i % 3 + 1) for i in range(4)]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(tp.DataLoader(ragged, batch_size=4, num_workers=1))


class Corrupt(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 13:
            raise OSError("Truncated File Read")
        return i


@pytest.mark.parametrize("num_workers", [0, 2, "auto"])
@pytest.mark.parametrize("batch_size", [4, None])
def test_getitem_errors_name_the_batch_and_the_index(num_workers, batch_size):
    with pytest.raises(OSError, match="Truncated File Read") as caught:
        list(tp.DataLoader(Corrupt(), batch_size=batch_size, num_workers=num_workers))
    batch = 3 if batch_size == 4 else 13
    assert (
        f"raised in torchpipe stage DataLoader at batch {batch}, dataset index 13"
        in caught.value.__notes__
    )


# -- stats() ------------------------------------------------------------------------------------


class SlowRows(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.tensor(i)


def test_worker_loader_stats_report_batches_workers_and_waiting():
    loader = tp.DataLoader(SlowRows(), batch_size=4, num_workers=2)
    assert loader.stats() == []
    it = iter(loader)
    for _ in range(20):
        next(it)
    stats = loader.stats()
    (stage,) = stats
    assert stage["produced"] == 20 and stage["knobs"]["num_workers"] == 2
    assert (stage["executor"], stage["workers"]) == ("process", 2)
    assert (
        set(stage["pids"]) <= {p.pid for p in psutil.Process().children(recursive=True)}
        and len(stage["pids"]) == 2
    )
    assert 0.008 <= stage["self_s"] < 0.2  # a batch of 4 items of 2 ms on a worker
    assert stats.bottleneck == "DataLoader workers (calls)" and "Limit: the pipeline" in str(stats)
    del it


def test_pipeline_loader_stats_are_the_pipelines():
    ds = tp.range(1000).map(
        lambda x: torch.tensor(x), num_parallel_calls=tp.AUTOTUNE, executor="thread"
    )
    loader = tp.DataLoader(ds, batch_size=8)
    it = iter(loader)
    for _ in range(10):
        next(it)
    stages = [s["stage"] for s in loader.stats()]
    assert "map(<lambda>)" in stages and "range" in stages


def test_stats_describe_the_last_pass_after_the_loop():
    loader = tp.DataLoader(torch.arange(100.0), batch_size=10, num_workers=2)
    assert "has not started" in loader.stats().report()
    for _ in loader:
        pass
    assert loader.stats()[0]["produced"] == 10  # the iterator is gone; its pass is still reported
    it = iter(loader)
    next(it), next(it)
    del it  # a pass left mid-epoch, as far as it went
    assert loader.stats()[0]["produced"] == 2


@pytest.mark.parametrize("num_workers", [0, "auto"])
def test_batches_show_in_torchs_profiler_as_torchs_do(num_workers, monkeypatch):
    """Only while a profiler records: without one the span is not opened (~5 us a cheap batch)."""
    loader = tp.DataLoader(list(range(8)), batch_size=2, num_workers=num_workers)
    with torch.profiler.profile() as prof:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    spans = [e.name for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
    assert len(spans) == 5  # a span a batch, and the one that ends the epoch
    opened = []
    span = torch.autograd.profiler.record_function

    def counted(name, *args, **kwargs):
        opened.append(name)
        return span(name, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counted)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not [name for name in opened if name.startswith("enumerate(DataLoader)#")]

"""The peers: the same per-item work through torchdata.nodes, SPDL, Grain and tf.data (FFCV: its own).

Each library has an adapter that builds its pipeline over the workload's own Python item
function and collation (``Items``), so every loader in a run does the same work per item, with
the same batch size, and hands the training loop the same batches (torch tensors). An adapter
gives a small grid of its library's own knobs (``PeerConfig``); ``bench/run.py`` measures each
point and reports the best as ``<library>_best``, like ``dataloader_best``, and a library's
zero-knob setting on its own where it has one (``tfdata_autotune``). The grid is the workload's
``tp_grid`` read in each library's terms: a thread count for its threads, a worker count for
its processes, so every library is tried at the parallelism ``torchpipe_best`` is.

On ``blobs`` (epochs on one loader) each adapter runs its library's epochs as a user would
(``PeerEpochs``): Grain keeps its threads or worker processes across epochs (one iterator over
the batches repeated), SPDL its process pool (a pipeline each epoch, as its pipelines make one
pass); torchdata.nodes restarts its workers on each epoch's ``reset()`` and tf.data its threads
on each epoch's iterator, as they do for any user.

tf.data's adapter lives in ``bench/tfdata.py``: it also has native pipelines (TensorFlow's own
ops) where TensorFlow has the ops. FFCV's, in ``bench/ffcv_peer.py``, runs no Python item: its
own ops over its own file format, on ``jpeg`` only (``ffcv_best``), so it is not one of the
Python peers the targets compare with. A library is imported only when its first pipeline is
made (FFCV when its configurations are: it writes its file then); one that is not installed has
no configuration and is reported "not installed".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import multiprocessing.process
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from bench import ffcv_peer, tfdata
from bench import workloads as wl
from bench.peer_items import (
    ITEM_TIMEOUT_S,
    STOP_TIMEOUT_S,
    BatchOf,
    Items,
    PeerConfig,
    PeerEpochs,
    PeerIterator,
    grid_of,
    items_of,
    one_pass,
)

NODES_PREFETCH = 2
"""torchdata.nodes' Prefetcher depth: DataLoader's default prefetch_factor."""
GRAIN_READ_AHEAD_BATCHES = 2
"""Grain's ``prefetch_buffer_size`` in batches (DataLoader's prefetch_factor). Grain's default,
500 elements, is chosen for 1-10 KiB elements on remote disks: 500 images here are 75-300 MB of
fresh memory, which slowed ``bigtensor`` by a third."""
GRAIN_WORKER_JOIN_S = 1.0
"""How long Grain waits for a stopping worker before killing it (Grain: 25 s). A worker whose
last batch is still in its queue's pipe cannot exit (``records``' batches of bytes are pickled
whole), so Grain would wait the whole 25 s after every such measurement."""


@dataclass(frozen=True)
class Peer:
    """A library under test: its configuration prefix, what to import, and its adapter."""

    library: str
    module: str
    distribution: str
    configs: Callable[[wl.Workload, bool], list[PeerConfig]] = field(compare=False)
    """``configs(work, quick)``: the library's grid on ``work`` (smaller when ``quick``)."""
    install: str = 'pip install -e ".[bench]"'
    """How to install it (the "not installed" note says)."""
    measured: str = "every workload"
    """Where it is measured (the note says)."""
    workloads: tuple[str, ...] | None = None
    """The workloads it has configurations on; None: every one."""
    load: Callable[[], Any] | None = field(default=None, compare=False)
    """Imports the library as its configurations would (None: ``importlib.import_module(module)``)."""

    def installed(self) -> bool:
        """Whether the library can be imported here."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:  # the parent package is missing
            return False

    def imported(self) -> Any:
        """The library, imported (``bench/isolate.py``'s :func:`~bench.isolate.preload` calls this
        in the parent that forks the library's rows)."""
        return self.load() if self.load is not None else importlib.import_module(self.module)

    def version(self) -> str:
        """The installed distribution's version ("" when it is not installed)."""
        for name in (
            self.distribution,
            self.module,
        ):  # tensorflow-cpu on x86-64, tensorflow elsewhere
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return ""


# -- torchdata.nodes ----------------------------------------------------------------------------
def nodes_configs(work: wl.Workload, quick: bool) -> list[PeerConfig]:
    """``Batcher`` + ``ParallelMapper`` on threads or processes, one batch a task (as DataLoader's
    workers: a task per item costs a queue hop each, which held ``tiny`` to 12k items/s on
    threads) + ``Prefetcher``. ``latency``'s shards are read one a task, flattened, batched."""
    items = items_of(work)
    return [
        _config({"num_workers": n, "method": method}, partial(_nodes, items, n, method))
        for n, method in grid_of(work, quick)
    ]


def _config(knobs: dict[str, Any], build: Callable[[], PeerEpochs]) -> PeerConfig:
    """A grid point whose pipeline ``build()`` makes: one pass of it on a timed workload, its
    epochs on an epochs workload."""
    return PeerConfig(knobs, partial(one_pass, build), epochs=build)


def _nodes(items: Items, workers: int, method: str) -> PeerEpochs:
    """One ``Loader``, iterated each epoch: torchdata.nodes restarts a ``ParallelMapper``'s
    workers on every ``reset()`` (it cannot keep them), so each epoch starts its own."""
    import torchdata.nodes as tn

    source = tn.IterableWrapper(range(items.length))
    if not items.fan_out:
        batched = tn.Batcher(source, items.batch_size, drop_last=False)
        node = tn.ParallelMapper(
            batched, BatchOf(items.fn, items.collate), num_workers=workers, method=method
        )
    else:
        node = tn.ParallelMapper(source, items.fn, num_workers=workers, method=method)
        if items.fan_out:
            node = tn.Unbatcher(node)
        node = tn.Mapper(tn.Batcher(node, items.batch_size, drop_last=False), items.collate)
    root = tn.Prefetcher(node, prefetch_factor=NODES_PREFETCH)
    loader = tn.Loader(root)
    return PeerEpochs(
        lambda: PeerIterator(iter(loader), lambda: _stop_nodes(root)), lambda: _stop_nodes(root)
    )


def _stop_nodes(root: Any) -> None:
    """Stop every thread and process of a torchdata.nodes graph, consumer side first.

    torchdata.nodes stops them only when an iterator is garbage collected, and joins a worker
    process for a few seconds at most: a worker whose last result is still in its queue's pipe
    cannot exit until it is read. The next measurement must not share the machine (or its
    memory count) with them, so they are stopped here, and terminated if still alive.
    """
    node = root
    while node is not None:
        running = getattr(node, "_it", None)
        while running is not None:  # a ParallelMapper's _it is a node whose _it runs the workers
            if hasattr(running, "_shutdown"):
                running._shutdown()
                for worker in getattr(running, "_workers", ()):
                    if (
                        isinstance(worker, multiprocessing.process.BaseProcess)
                        and worker.is_alive()
                    ):
                        worker.terminate()
                        worker.join(STOP_TIMEOUT_S)
            running = getattr(running, "_it", None)
        node = getattr(node, "source", None)


# -- SPDL -----------------------------------------------------------------------------------------
def spdl_configs(work: wl.Workload, quick: bool) -> list[PeerConfig]:
    """``PipelineBuilder`` over batches of indices, ``pipe(concurrency=n)`` making one batch a task
    on its thread pool or on a ``ProcessPoolExecutor`` of ``n`` processes (SPDL's own advice:
    each item that passes between stages costs an event-loop hop, ~0.1 ms, so work is batched
    before it is dispatched). ``latency``'s shards are read one a task and flattened."""
    items = items_of(work)
    return [
        _config({"concurrency": n, "executor": executor}, partial(_spdl, items, n, executor))
        for n, executor in grid_of(work, quick)
    ]


_installed_task: BatchOf | None = None


def _install_task(task: BatchOf) -> None:
    """A worker process's initializer: keep the task, so it is not pickled with every call."""
    global _installed_task
    _installed_task = task


def _run_installed_task(indices: list[int]) -> Any:
    assert _installed_task is not None, "the process pool's initializer did not run"
    return _installed_task(indices)


def _index_batches(length: int, batch_size: int) -> Iterator[list[int]]:
    return (list(range(k, min(k + batch_size, length))) for k in range(0, length, batch_size))


def _spdl(items: Items, concurrency: int, executor: str) -> PeerEpochs:
    """A pipeline built each epoch (SPDL's pipelines make one pass), on one process pool kept
    across epochs where processes run the work (a user can hand every epoch's pipeline the same
    executor); its threads are the pipeline's own, started each epoch."""
    pool = None
    task: Callable[[list[int]], Any] = BatchOf(items.fn, items.collate)
    if executor == "process":
        pool = (
            ProcessPoolExecutor(concurrency)
            if items.fan_out
            else ProcessPoolExecutor(concurrency, initializer=_install_task, initargs=(task,))
        )
        task = task if items.fan_out else _run_installed_task

    def stop() -> None:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    return PeerEpochs(partial(_spdl_epoch, items, concurrency, pool, task), stop)


def _spdl_epoch(
    items: Items,
    concurrency: int,
    pool: ProcessPoolExecutor | None,
    task: Callable[[list[int]], Any],
) -> PeerIterator:
    """One epoch of SPDL's pipeline, on ``pool`` where there is one."""
    from spdl.pipeline import PipelineBuilder

    if items.fan_out:
        builder = (
            PipelineBuilder()
            .add_source(range(items.length))
            .pipe(items.fn, concurrency=concurrency, executor=pool)
            .disaggregate()
            .aggregate(items.batch_size)
            .pipe(items.collate)
        )
    else:
        builder = (
            PipelineBuilder()
            .add_source(_index_batches(items.length, items.batch_size))
            .pipe(task, concurrency=concurrency, executor=pool)
        )
    pipeline = builder.add_sink().build(num_threads=concurrency)
    pipeline.start()
    batches = iter(pipeline.get_iterator(timeout=ITEM_TIMEOUT_S))
    return PeerIterator(batches, lambda: pipeline.stop(timeout=STOP_TIMEOUT_S))


# -- Grain ----------------------------------------------------------------------------------------
def grain_configs(work: wl.Workload, quick: bool) -> list[PeerConfig]:
    """``MapDataset`` over batch numbers, one batch an element (``BatchAt``), + ``to_iter_dataset``
    with ``ReadOptions(num_threads=n)``, or with its multiprocessing prefetch (``mp_prefetch``,
    ``n`` worker processes, each reading in order); two batches read ahead
    (``GRAIN_READ_AHEAD_BATCHES``). ``latency``'s shards are read one an element, flattened and
    batched."""
    items = items_of(work)
    return [
        _config({"workers": n, "kind": kind}, partial(_grain, items, n, kind))
        for n, kind in grid_of(work, quick)
    ]


class _Records:
    """Grain's flat map of a list of items (``latency``'s shards) to the items."""

    def __init__(self, most: int) -> None:
        import grain

        # A subclass made here: grain is imported only when a Grain pipeline is built.
        self.transform = type(
            "FlattenList",
            (grain.experimental.FlatMapTransform,),
            {"max_fan_out": most, "flat_map": lambda self, element: element},
        )()


class NumpyBatch:
    """``collate`` with its tensors handed over as NumPy arrays (views, no copy): Grain's worker
    processes move NumPy arrays through their shared memory, but pickle torch tensors by file
    descriptor, which fails once the worker that sent one has stopped."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[Any]) -> Any:
        return map_leaves(
            self.collate(items),
            lambda leaf: leaf.numpy() if isinstance(leaf, torch.Tensor) else leaf,
        )


def map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of a batch of dicts, lists and tuples."""
    if isinstance(value, dict):
        return {key: map_leaves(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_leaves(item, fn) for item in value)
    return fn(value)


def numpy_to_torch(batch: Any) -> Any:
    return map_leaves(
        batch, lambda leaf: torch.from_numpy(leaf) if isinstance(leaf, np.ndarray) else leaf
    )


class BatchAt:
    """Batch number ``b`` to ``task``'s batch of indices ``b * batch_size`` onwards: Grain's map
    over batch numbers, so one map element is one batch (its per-element overhead paid once)."""

    def __init__(self, task: Callable[[list[int]], Any], length: int, batch_size: int) -> None:
        self.task, self.length, self.batch_size = task, length, batch_size

    def __call__(self, b: int) -> Any:
        start = b * self.batch_size
        return self.task(list(range(start, min(start + self.batch_size, self.length))))


def _grain(items: Items, workers: int, kind: str) -> PeerEpochs:
    """Epochs as a Grain user keeps workers across them: the batches repeated (``repeat()``)
    and iterated by one iterator, whose threads or worker processes serve every epoch, an epoch
    being the next ``batches`` of them (``_grain_epochs``). ``latency``'s stream is one pass."""
    import grain

    # Threads read ahead in the main process; with worker processes each reads its slice in
    # order (num_threads=0: Grain's advice for data that needs no I/O wait) and mp_prefetch
    # overlaps the workers with the consumer. Tensors cross processes as NumPy (NumpyBatch).
    collate = items.collate if kind == "thread" else NumpyBatch(items.collate)
    if items.fan_out:
        mapped = grain.MapDataset.range(items.length).map(items.fn)
        per_batch = -(-items.batch_size // items.fan_out)  # shards a batch
    else:
        batches = -(-items.length // items.batch_size)
        mapped = grain.MapDataset.range(batches).map(
            BatchAt(BatchOf(items.fn, collate), items.length, items.batch_size)
        )
        mapped, per_batch = mapped.repeat(), 1
    ahead = max(GRAIN_READ_AHEAD_BATCHES * per_batch, workers)
    read = grain.ReadOptions(
        num_threads=workers if kind == "thread" else 0, prefetch_buffer_size=ahead
    )
    ds = mapped.to_iter_dataset(read)
    if items.fan_out:
        ds = grain.experimental.FlatMapIterDataset(ds, _Records(items.fan_out).transform)
        ds = ds.batch(items.batch_size, batch_fn=collate)
    convert = None
    if kind == "process":
        from grain._src.python.dataset.transformations import process_prefetch

        process_prefetch._PROCESS_KILL_TIMEOUT_S = GRAIN_WORKER_JOIN_S  # see its docstring
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        convert = numpy_to_torch
    return _grain_epochs(ds, None if items.fan_out else batches, convert)


def _grain_epochs(
    ds: Any, per_epoch: int | None, convert: Callable[[Any], Any] | None
) -> PeerEpochs:
    """Epochs of ``per_epoch`` elements cut from one iterator of ``ds``, made at the first epoch
    and closed with the loader (``per_epoch`` None: the first epoch is all there is)."""
    held: dict[str, Any] = {}

    def epoch() -> PeerIterator:
        if "iterator" not in held:
            held["iterator"] = iter(ds)
        return PeerIterator(itertools.islice(held["iterator"], per_epoch), convert=convert)

    def stop() -> None:
        iterator = held.pop("iterator", None)
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()

    return PeerEpochs(epoch, stop)


FFCV_INSTALL = "apt-get install libturbojpeg0-dev libopencv-dev pkg-config; pip install numba ffcv"
"""FFCV builds from source against these (not in the extras: CI does not build it)."""

PEERS = (
    Peer("nodes", "torchdata.nodes", "torchdata", nodes_configs),
    Peer("spdl", "spdl.pipeline", "spdl", spdl_configs),
    Peer("grain", "grain", "grain", grain_configs),
    Peer(
        "ffcv",
        "ffcv",
        "ffcv",
        ffcv_peer.configs,
        install=FFCV_INSTALL,
        measured="jpeg only (its own ops)",
        workloads=("jpeg",),
    ),
    Peer("tfdata", "tensorflow", "tensorflow-cpu", tfdata.configs, load=tfdata.import_tensorflow),
)
"""Every peer, in the order they run. tf.data runs last (``bench/run.py``'s ``LAST``): importing
TensorFlow starts threads and maps ~0.5 GB, which every process forked after it would inherit, so
the parent imports it once, after every other row, and forks tf.data's rows from there."""


def notes() -> dict[str, str]:
    """Each peer: its version and configurations, or "not installed" and how to install it."""
    out = {}
    for peer in PEERS:
        if not peer.installed():
            out[peer.library] = f"not installed ({peer.distribution}: {peer.install}): not measured"
            continue
        out[peer.library] = f"{peer.distribution} {peer.version()}: measured on {peer.measured}"
    return out

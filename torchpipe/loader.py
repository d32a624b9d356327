"""``torchpipe.DataLoader``: torch's DataLoader, argument for argument, on torchpipe's engine.

It *is* a ``torch.utils.data.DataLoader`` (a subclass): construction, argument checking, error
messages, read-only attributes, samplers, ``len()`` and the way the ``generator`` is consumed are
torch's own. What changes is how batches are made when ``num_workers > 0``: in worker processes
forked from a zygote, returned through shared memory without a copy, with dead workers replaced.
New words: ``num_workers="auto"`` and ``device=...``; ``state_dict()``/``load_state_dict()``
resume an epoch in the middle.
"""

from __future__ import annotations

import inspect
import itertools
import random
import time
import weakref
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.collate as torch_collate
import torch.utils.data._utils.worker as torch_worker
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data import dataloader as torch_dataloader

from torchpipe.autotune.live import CONSUMER
from torchpipe.autotune.report import WAITING_LIMIT as _WAITING_LIMIT
from torchpipe.autotune.report import PipelineStats
from torchpipe.dataset import Dataset
from torchpipe.ops.device import DevicePrefetcher, check_device
from torchpipe.runtime.codec import StackedTensor
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.process_pool import ProcessPool, process_executor_supported

_WAIT_S = 0.5
_FORK = ("fork", None)
_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters


class DataLoader(torch.utils.data.DataLoader):
    """A drop-in ``torch.utils.data.DataLoader``; see torch's documentation for the arguments.

    Args:
        num_workers: as torch's, or ``"auto"``: as many workers as usable CPU cores.
        device: ``None`` (batches stay on the CPU), or a device such as ``"cuda"``: batches
            arrive there, copied ahead through pinned memory on a side stream.
        dataset: also a ``tp.Dataset`` pipeline, which runs in this process with its own
            parallel stages (``num_workers`` does not replicate it).
        (every other argument is torch's)

    Raises:
        ValueError, TypeError: exactly where torch's DataLoader raises them.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
    ) -> None:
        workers_auto = num_workers == "auto"
        if workers_auto:
            num_workers = usable_cpu_count()
        newer = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
            drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, **newer,
        )  # fmt: skip
        if not _TORCH_HAS_IN_ORDER:
            self.in_order = in_order  # torch < 2.6 lacks it; torchpipe's workers honour it
        self.__dict__["_tp"] = _LoaderState(None if device is None else check_device(device))
        self._tp.workers_auto = workers_auto

    @property
    def device(self) -> torch.device | None:
        """Where batches arrive (``None``: the CPU, as torch's DataLoader)."""
        return self._tp.device

    def __iter__(self) -> Any:
        state = self._tp
        state.epoch_rng = _rng_state(self.generator)
        iterator = super().__iter__()  # torch's own logic, persistent workers included
        resume, state.resume = state.resume, None
        if resume:
            _skip(iterator, resume)
        if state.device is not None and state.device.type != "cpu":
            iterator = DevicePrefetcher(iterator, state.device, delivered=resume or 0)
        state.current = weakref.ref(iterator)
        return iterator

    def _get_iterator(self) -> Any:
        if isinstance(self.dataset, Dataset):
            # A torchpipe pipeline runs its own parallel stages; replicating it into workers
            # would repeat its elements.
            return _PipelineIterator(self)
        if self.num_workers > 0 and _engine_can_run(self):
            return _WorkerIterator(self)
        return super()._get_iterator()

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch is: load it into a loader built the same way to get the rest.

        The state is the RNG state the epoch started from and how many batches it has yielded;
        resuming replays the epoch's sampling (no data is loaded) up to that point.
        """
        state = self._tp
        current = state.current() if state.current is not None else None
        if current is None:
            yielded = 0
        elif isinstance(current, DevicePrefetcher):
            yielded = current.delivered  # the copy thread runs ahead of what was handed over
        else:
            yielded = current._num_yielded
        return {"format": 1, "epoch_rng": state.epoch_rng, "yielded": yielded}

    def stats(self) -> PipelineStats:
        """The current epoch's stats; ``print()`` them for a report naming the bottleneck.

        For a ``tp.Dataset`` these are its pipeline's (every stage); for a map-style or iterable
        Dataset on workers, the workers' throughput, their time per batch and how long the
        training loop waited for batches.
        """
        current = self._tp.current() if self._tp.current is not None else None
        if isinstance(current, DevicePrefetcher):
            current = current._source
        if isinstance(current, _PipelineIterator):
            return current.pipeline_stats()
        if isinstance(current, _WorkerIterator):
            return current.stats()
        return PipelineStats([], 0.0, "", 0.0, [])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue the epoch ``state`` was taken in.

        Raises:
            ValueError: for something that is not a ``DataLoader.state_dict()``.
        """
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError("not a torchpipe DataLoader state (missing or unknown 'format')")
        _set_rng_state(self.generator, state["epoch_rng"])
        self._tp.resume = int(state["yielded"])
        self._tp.epoch_rng = state["epoch_rng"]


class _LoaderState:
    """torchpipe's own attributes of a DataLoader (kept apart from torch's guarded ones)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.epoch_rng: Any = None
        self.current: weakref.ref | None = None
        self.resume: int | None = None
        self.workers_auto = False


def explain(pipeline: Dataset | torch.utils.data.DataLoader) -> str:
    """How ``pipeline`` (a ``tp.Dataset`` or a DataLoader) is set up and how it will run.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(pipeline, Dataset):
        return pipeline.explain()
    if not isinstance(pipeline, torch.utils.data.DataLoader):
        raise TypeError(f"explain() takes a tp.Dataset or a DataLoader, got {type(pipeline).__name__}")
    return "\n".join(_loader_lines(pipeline))


def _loader_lines(loader: torch.utils.data.DataLoader) -> list[str]:
    state: _LoaderState | None = loader.__dict__.get("_tp")
    dataset = loader.dataset
    workers = f"{loader.num_workers} (auto: usable cores)" if state is not None and state.workers_auto else str(loader.num_workers)
    kind = "a tp.Dataset pipeline" if isinstance(dataset, Dataset) else (
        "an IterableDataset" if isinstance(dataset, torch.utils.data.IterableDataset) else "a map-style dataset"
    )
    sampler = type(loader.sampler).__name__
    collate = getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__)
    lines = [
        f"{'tp' if isinstance(loader, DataLoader) else 'torch'} DataLoader as written:",
        f"  dataset: {type(dataset).__name__} ({kind})",
        f"  batch_size={loader.batch_size}, drop_last={loader.drop_last}, sampler: {sampler}, collate_fn: {collate}",
        f"  num_workers={workers}, prefetch_factor={loader.prefetch_factor}, "
        f"persistent_workers={loader.persistent_workers}, pin_memory={loader.pin_memory}",
        "As it will run:",
    ]
    if isinstance(dataset, Dataset) and isinstance(loader, DataLoader):
        lines.append("  the pipeline runs in this process with its own parallel stages (num_workers unused):")
        lines.extend("    " + line for line in dataset.explain().splitlines())
    elif not isinstance(loader, DataLoader):
        lines.append("  torch's own iterator (torch.utils.data.DataLoader)")
    elif loader.num_workers > 0 and _engine_can_run(loader):
        fetch = "__getitems__" if hasattr(dataset, "__getitems__") else "dataset[i] per index"
        to_shm = " (tensors stacked straight into shared memory)" if loader.collate_fn is torch_collate.default_collate else ""
        lines.append(
            f"  {loader.num_workers} worker processes forked from a zygote; a task per batch: {fetch}, "
            f"then {collate}{to_shm}; {(loader.prefetch_factor or 2) * loader.num_workers} batches in flight, "
            f"delivered {'in sampler order' if loader.in_order else 'as they finish'}; a dead worker is replaced"
        )
    else:
        why = "num_workers=0" if loader.num_workers == 0 else "a spawn/forkserver context"
        lines.append(f"  torch's own iterator ({why})")
    if state is not None and state.device is not None and state.device.type != "cpu":
        lines.append(f"  then copied to {state.device} ahead of use: pinned buffers, a side CUDA stream")
    return lines


def _rng_state(generator: torch.Generator | None) -> torch.Tensor:
    return generator.get_state() if generator is not None else torch.get_rng_state()


def _set_rng_state(generator: torch.Generator | None, state: torch.Tensor) -> None:
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def _engine_can_run(loader: DataLoader) -> bool:
    """Our workers fork; a ``spawn``/``forkserver`` context (or no Linux) gets torch's own."""
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else None
    return process_executor_supported() and method in _FORK


def _skip(iterator: Any, count: int) -> None:
    """Advance a fresh iterator by ``count`` batches: map-style by sampling alone."""
    if isinstance(iterator, _WorkerIterator):
        iterator.skip(count)
        return
    for _ in range(count):
        if iterator._dataset_kind == torch_dataloader._DatasetKind.Map:
            iterator._next_index()
        else:
            iterator._next_data()
        iterator._num_yielded += 1


class _PipelineIterator(torch_dataloader._BaseDataLoaderIter):
    """Batches from a ``tp.Dataset`` iterated in this process (whatever ``num_workers`` says)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._fetcher = self._make_fetcher()

    def _make_fetcher(self) -> Any:
        return torch_dataloader._DatasetKind.create_fetcher(
            self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn, self._drop_last
        )

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._fetcher = self._make_fetcher()  # a new epoch of the pipeline

    def _next_data(self) -> Any:
        data = self._fetcher.fetch(self._next_index())
        return pin_memory(data, self._pin_memory_device) if self._pin_memory else data

    def pipeline_stats(self) -> PipelineStats:
        pipeline = getattr(self._fetcher, "dataset_iter", None)
        return pipeline.stats() if pipeline is not None else PipelineStats([], 0.0, "", 0.0, [])


def _stack_later(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    """torch's tensor collation, except that same-shape plain tensors are stacked straight into
    the shared-memory record the batch is sent in (torch's own would allocate a new shared
    segment per batch)."""
    first = batch[0]
    plain = all(
        type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu"
        and t.shape == first.shape and t.dtype == first.dtype
        for t in batch
    )
    if plain:
        return StackedTensor(batch)
    return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_WORKER_COLLATE_MAP = {**torch_collate.default_collate_fn_map, torch.Tensor: _stack_later}


def _collate_into_shared_memory(batch: list[Any]) -> Any:
    """``default_collate`` with exactly its semantics, stacking tensors into shared memory."""
    return torch_collate.collate(batch, collate_fn_map=_WORKER_COLLATE_MAP)


class _Exhausted:
    """What a worker returns once its IterableDataset replica has ended."""


class _FetchTask:
    """Runs in each worker: torch's worker set-up, then torch's fetcher for every index.

    Seeds ``random``, torch and numpy exactly as torch's workers do (``base_seed + worker_id``),
    sets ``get_worker_info()``, calls ``worker_init_fn``, and makes the fetcher (for an
    IterableDataset, the worker's own replica). An error in that set-up is raised for every
    task, as torch does.
    """

    def __init__(self, loader: DataLoader, base_seed: int) -> None:
        self.dataset = loader.dataset
        self.kind = loader._dataset_kind
        self.auto_collation = loader._auto_collation
        self.collate_fn = loader.collate_fn
        self.drop_last = loader.drop_last
        self.num_workers = loader.num_workers
        self.worker_init_fn = loader.worker_init_fn
        self.base_seed = base_seed
        self.fetcher: Any = None
        self.epoch = 0
        self.init_error: BaseException | None = None

    def start_worker(self, worker_id: int) -> None:
        seed = self.base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(torch_worker._generate_state(self.base_seed, worker_id))
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=self.num_workers, seed=seed, dataset=self.dataset
        )
        try:
            if self.worker_init_fn is not None:
                self.worker_init_fn(worker_id)
            self._make_fetcher()
        except Exception as e:  # noqa: BLE001 - raised for each task, like torch's workers
            self.init_error = e

    def _make_fetcher(self) -> None:
        collate_fn = self.collate_fn
        if collate_fn is torch_collate.default_collate:
            collate_fn = _collate_into_shared_memory
        self.fetcher = torch_dataloader._DatasetKind.create_fetcher(
            self.kind, self.dataset, self.auto_collation, collate_fn, self.drop_last
        )

    def __call__(self, seq: int, payload: tuple[int, Any]) -> Any:
        if self.init_error is not None:
            raise self.init_error
        epoch, index = payload
        if epoch != self.epoch:  # a persistent worker's next epoch: a fresh replica iterator
            self.epoch = epoch
            self._make_fetcher()
        try:
            return self.fetcher.fetch(index)
        except StopIteration:
            return _Exhausted()


class _WorkerIterator(torch_dataloader._BaseDataLoaderIter):
    """Batches from worker processes, in torch's order: index ``k`` goes to worker ``k % n``.

    Like torch's multiprocessing iterator it keeps ``prefetch_factor * num_workers`` batches in
    flight, skips workers whose IterableDataset replica has ended, and raises after ``timeout``
    seconds without a batch. Results arrive through shared memory; a dead worker is replaced
    and its batches fetched again.
    """

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._in_order = loader.in_order
        self._prefetch = (loader.prefetch_factor or 2) * self._num_workers
        self._pool = ProcessPool(_FetchTask(loader, self._base_seed), self._num_workers, "DataLoader")
        self._pool.start()
        self._epoch = -1
        self._send_idx = 0  # sequence numbers run on across epochs: late results of a broken-off
        self._start_epoch()  # epoch can never be taken for this one's

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        """The next epoch with the same (persistent) workers, as torch's iterator does."""
        super()._reset(loader, first_iter)
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._epoch_started, self._waited, self._batches = time.perf_counter(), 0.0, 0
        self._epoch += 1
        self._active = [True] * self._num_workers
        self._slots = itertools.cycle(range(self._num_workers))
        self._task_slot: dict[int, int] = {}
        self._done: dict[int, tuple[Any, BaseException | None]] = {}
        self._rcvd_idx = self._send_idx
        for _ in range(self._prefetch):
            self._try_put_index()

    def _try_put_index(self) -> None:
        if not any(self._active):
            return
        try:
            index = self._next_index()
        except StopIteration:
            return
        slot = next(s for s in self._slots if self._active[s])
        self._task_slot[self._send_idx] = slot
        self._pool.submit(self._send_idx, (self._epoch, index), slot=slot)
        self._send_idx += 1

    def skip(self, count: int) -> None:
        """Resume support: drop ``count`` batches (map-style: without fetching them)."""
        for _ in range(count):
            self._next_data()
            self._num_yielded += 1

    def _next_data(self) -> Any:
        while True:
            seq = self._next_ready()
            value, error = self._done.pop(seq)
            slot = self._task_slot.pop(seq)
            if isinstance(value, _Exhausted):
                self._active[slot] = False
                self._try_put_index()
                continue
            self._try_put_index()
            if error is not None:
                raise error
            self._batches += 1
            return pin_memory(value, self._pin_memory_device) if self._pin_memory else value

    def stats(self) -> PipelineStats:
        """This epoch's numbers: batches, the workers' time per batch, the loop's waiting."""
        seconds = max(time.perf_counter() - self._epoch_started, 1e-9)
        calls, work_s, _ = self._pool.timing.totals()
        stage = {"stage": "DataLoader workers", "depth": 0, "produced": self._batches,
                 "throughput": self._batches / seconds, "self_s": work_s / max(calls, 1),
                 "wait_ratio": self._waited / seconds, "knobs": {"num_workers": self._num_workers,
                                                                 "in_flight": self._prefetch}}  # fmt: skip
        waiting = self._waited / seconds
        limit = "DataLoader workers" if waiting >= _WAITING_LIMIT else CONSUMER
        return PipelineStats([stage], seconds, limit, waiting, [])

    def _next_ready(self) -> int:
        """The sequence number to deliver next, waiting for it (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            while self._rcvd_idx < self._send_idx and self._rcvd_idx not in self._task_slot:
                self._rcvd_idx += 1  # delivered out of order earlier
            if not self._task_slot:
                self._shutdown_if_done()
                raise StopIteration
            ready = self._rcvd_idx if self._in_order else next(iter(self._done), None)
            if ready is not None and ready in self._done:
                return ready
            wait = _WAIT_S if deadline is None else max(0.0, min(_WAIT_S, deadline - time.monotonic()))
            if deadline is not None and wait == 0:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            t0 = time.perf_counter()
            results = self._pool.collect(wait)
            self._waited += time.perf_counter() - t0
            for done_seq, value, error in results:
                if done_seq in self._task_slot:  # not a late result of an abandoned epoch
                    self._done[done_seq] = (value, error)

    def _shutdown_if_done(self) -> None:
        if not self._persistent_workers:
            self._pool.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()

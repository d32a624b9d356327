"""The DataLoader's worker processes: torch's fetch logic, run on torchpipe's process pool.

:class:`WorkerIterator` is what ``iter(tp.DataLoader(..., num_workers=n))`` returns for a
map-style or iterable dataset when workers can fork: batches are fetched in worker processes
with torch's own fetchers and seeds, stacked straight into shared memory, and delivered in
torch's order. A dead worker is replaced and its batches fetched again.
"""

from __future__ import annotations

import itertools
import random
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.data._utils.collate as torch_collate
import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import dataloader as torch_dataloader
from torch.utils.data._utils.pin_memory import pin_memory

from torchpipe.autotune.live import start_look
from torchpipe.autotune.report import PipelineStats, pipeline_stats
from torchpipe.autotune.runner import Autotuner, ConsumerClock
from torchpipe.autotune.tuner import Budget
from torchpipe.ops.stats import IteratorStats, LiveKnob
from torchpipe.runtime.codec import StackedTensor
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.process_pool import ProcessPool

if TYPE_CHECKING:
    from torchpipe.loader import DataLoader

_WAIT_S = 0.5


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

    def __init__(self, loader: DataLoader, base_seed: int, num_workers: int) -> None:
        self.dataset = loader.dataset
        self.kind = loader._dataset_kind
        self.auto_collation = loader._auto_collation
        self.collate_fn = loader.collate_fn
        self.drop_last = loader.drop_last
        self.num_workers = num_workers  # what get_worker_info() says: the most workers there may be
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


class WorkerIterator(torch_dataloader._BaseDataLoaderIter):
    """Batches from worker processes, in torch's order: index ``k`` goes to worker ``k % n``
    (with ``num_workers="auto"`` over a map-style dataset, to the least busy worker of a pool the
    autotuner resizes; batches still arrive in sampler order).

    Like torch's multiprocessing iterator it keeps ``prefetch_factor * num_workers`` batches in
    flight, skips workers whose IterableDataset replica has ended, and raises after ``timeout``
    seconds without a batch. Results arrive through shared memory; a dead worker is replaced
    and its batches fetched again.
    """

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._in_order = loader.in_order
        self._factor = loader.prefetch_factor or 2
        # num_workers="auto" over a map-style dataset: the tuner sizes the pool while it runs,
        # from where the last epoch left it. (An IterableDataset's replicas are split by worker
        # count: that stays fixed.)
        tuned = loader._tp.workers_auto and self._dataset_kind == torch_dataloader._DatasetKind.Map
        most = max(self._num_workers, 2 * usable_cpu_count()) if tuned else self._num_workers
        self._tp_state = loader._tp
        if tuned and self._tp_state.tuned_workers is not None:
            self._num_workers = min(most, self._tp_state.tuned_workers)
        self._prefetch = self._factor * self._num_workers
        self._knob = _workers_knob(self, self._num_workers, most) if tuned else None
        self._pool = ProcessPool(_FetchTask(loader, self._base_seed, most), self._num_workers, "DataLoader")
        self._pool.start()
        self._tuner: Autotuner | None = None
        self._tuner_stop: weakref.finalize | None = None
        self._epoch = -1
        self._send_idx = 0  # sequence numbers run on across epochs: late results of a broken-off
        self._start_epoch()  # epoch can never be taken for this one's

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        """The next epoch with the same (persistent) workers, as torch's iterator does."""
        super()._reset(loader, first_iter)
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._stop_tuner()
        self._stage = _WorkersStage(self._pool, self._factor, self._knob)
        self._clock, self._started = ConsumerClock(), start_look()
        if self._knob is not None:
            self._tuner = Autotuner(self._stage, self._clock, Budget.of_machine())
            if self._tuner_stop is not None:
                self._tuner_stop.detach()
            self._tuner_stop = weakref.finalize(self, self._tuner.stop)  # a dropped iterator stops it
        self._epoch += 1
        self._active = [True] * self._num_workers
        self._slots = itertools.cycle(range(self._num_workers))
        self._task_slot: dict[int, int | None] = {}
        self._done: dict[int, tuple[Any, BaseException | None]] = {}
        self._rcvd_idx = self._send_idx
        self._fill()

    def _fill(self) -> None:
        """Put indices until ``prefetch_factor`` batches per worker are in flight (or none are left)."""
        while len(self._task_slot) < self._prefetch and any(self._active):
            try:
                index = self._next_index()
            except StopIteration:
                return
            # Fixed workers get torch's order (batch k to worker k % n); a tuned pool, the least busy.
            slot = next(s for s in self._slots if self._active[s]) if self._knob is None else None
            self._task_slot[self._send_idx] = slot
            self._pool.submit(self._send_idx, (self._epoch, index), slot=slot)
            self._send_idx += 1

    def _set_workers(self, n: int) -> None:
        """Resize the pool (the tuner's request, applied between two batches): retired workers
        finish their batches first, and batches keep their sequence numbers, so none is lost,
        repeated or reordered."""
        self._pool.resize(n)
        self._prefetch = self._factor * n
        self._tp_state.tuned_workers = n
        self._fill()

    def skip(self, count: int) -> None:
        """Resume support: drop ``count`` batches (map-style: without fetching them)."""
        for _ in range(count):
            self._next_data()
            self._num_yielded += 1

    def _next_data(self) -> Any:
        self._clock.enter()
        if self._knob is not None:
            self._knob.take_request()
        stats, started, waited = self._stage.stats, time.perf_counter(), 0.0
        while True:
            seq, seq_waited = self._next_ready()  # at the end: StopIteration, the tuner stopped
            waited += seq_waited
            value, error = self._done.pop(seq)
            slot = self._task_slot.pop(seq)
            if isinstance(value, _Exhausted):
                self._active[slot] = False
                self._fill()
                continue
            self._fill()
            if error is not None:
                raise error
            stats.look(len(self._done), self._prefetch)
            stats.produced += 1
            stats.wait_s += waited
            stats.clocked(time.perf_counter() - started, waited)
            stats.sample_bytes(value)
            if self._tuner is not None and not self._tuner.started:
                self._tuner.start()  # with the first batch, as a pipeline's tuner
            self._clock.leave()
            return pin_memory(value, self._pin_memory_device) if self._pin_memory else value

    def stats(self) -> PipelineStats:
        """This epoch's numbers: batches, the workers' time per batch, the loop's waiting, the
        worker count (and the tuner's rounds, with ``num_workers="auto"``)."""
        decisions = list(self._tuner.decisions) if self._tuner is not None else []
        stats = pipeline_stats(self._stage, self._started, self._clock.outside_s(), decisions)
        stats[0]["knobs"] = {"num_workers": self._pool.size, "in_flight": self._prefetch}
        return stats

    def _stop_tuner(self) -> None:
        if self._tuner is not None:
            self._tuner.stop()

    def _next_ready(self) -> tuple[int, float]:
        """The sequence number to deliver next, waiting for it (at most ``timeout`` seconds), and
        the seconds waited."""
        waited = 0.0
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            while self._rcvd_idx < self._send_idx and self._rcvd_idx not in self._task_slot:
                self._rcvd_idx += 1  # delivered out of order earlier
            if not self._task_slot:
                self._shutdown_if_done()
                raise StopIteration
            ready = self._rcvd_idx if self._in_order else next(iter(self._done), None)
            if ready is not None and ready in self._done:
                return ready, waited
            wait = _WAIT_S if deadline is None else max(0.0, min(_WAIT_S, deadline - time.monotonic()))
            if deadline is not None and wait == 0:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            t0 = time.perf_counter()
            results = self._pool.collect(wait)
            waited += time.perf_counter() - t0
            for done_seq, value, error in results:
                if done_seq in self._task_slot:  # not a late result of an abandoned epoch
                    self._done[done_seq] = (value, error)

    def _shutdown_if_done(self) -> None:
        self._stop_tuner()
        if not self._persistent_workers:
            self._pool.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()


class _WorkersStage:
    """A DataLoader's workers as the autotuner and the report see them: one pool stage, no input.

    It counts the batches delivered (and the loop's waits) in the iterator stats every op keeps;
    the workers' time per batch comes from the pool.
    """

    name = "DataLoader workers"
    tuning_role = "pool"

    def __init__(self, pool: ProcessPool, per_worker: int, knob: LiveKnob | None) -> None:
        self.stats = IteratorStats()
        self.stats.calls = pool.timing
        self._pool, self._per_worker, self._knob = pool, per_worker, knob

    def children(self) -> list[Any]:
        return []

    def knobs(self) -> list[LiveKnob]:
        return [self._knob] if self._knob is not None else []

    def parallelism(self) -> int:
        return self._pool.size

    def buffer_slots(self) -> int:
        return self._per_worker * self._pool.size

    def calls_in_processes(self) -> bool:
        return True


def _workers_knob(iterator: WorkerIterator, value: int, most: int) -> LiveKnob:
    """The tuner's knob for the worker count; it holds the iterator weakly (the tuner's thread
    must not keep a dropped iterator, and its workers, alive)."""
    ref = weakref.ref(iterator)

    def apply(n: int) -> None:
        live = ref()
        if live is not None:
            live._set_workers(n)

    return LiveKnob(f"{_WorkersStage.name}.parallelism", value, 1, most, False, apply)

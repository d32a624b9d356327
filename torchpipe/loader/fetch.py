"""How one batch of a DataLoader is fetched: torch's fetcher and collation, in a worker process or
in this process, with the global RNGs seeded as torch seeds them (or per batch, for
``num_workers="auto"``) and errors noted with the batch and the dataset index that failed.

:class:`FetchTask` is what each worker process runs (torch's worker set-up, then a batch a task);
:class:`LocalFetch` fetches in this process, inline or on threads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data._utils.collate as torch_collate
import torch.utils.data._utils.fetch as torch_fetch
from torch.utils.data import dataloader as torch_dataloader

from torchpipe.errors import add_note
from torchpipe.loader.collate import ColumnCollate
from torchpipe.loader.replicas import EndedOnReplay, Replicas
from torchpipe.randomness import (
    call_seeded,
    enter_call,
    exit_call,
    global_rng_states,
    mix_seed,
    restore_global_rng_states,
    seed_global_rngs,
)
from torchpipe.runtime.codec import StackedTensor, stackable
from torchpipe.runtime.heap import MAPPED_MAX, hold_free
from torchpipe.runtime.recycle import MIN_BYTES, RecycledStack, delivered
from torchpipe.runtime.sizes import heap_bytes

DataLoader = torch.utils.data.DataLoader
"""What a fetch is made from: a ``tp.DataLoader`` (a torch one, with torchpipe's state in its
``__dict__`` as ``_tp``; loader/dataloader.py, which imports this package's modules)."""


def _stack_later(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
    """torch's tensor collation, except that same-shape plain tensors are stacked straight into
    the shared-memory record the batch is sent in (torch's own would allocate a new shared
    segment per batch)."""
    if stackable(batch):
        return StackedTensor(batch, checked=True)
    return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_WORKER_COLLATE_MAP = {**torch_collate.default_collate_fn_map, torch.Tensor: _stack_later}

_collate_into_shared_memory = ColumnCollate(_WORKER_COLLATE_MAP, stackers=(_stack_later,))
"""``default_collate`` with exactly its semantics, a column at a time, stacking tensors into shared memory."""


def recycling_collate(memory: RecycledStack) -> Callable[[list[Any]], Any]:
    """``default_collate`` with exactly its semantics, a column at a time (loader/collate.py),
    stacking same-shape plain tensors into ``memory``'s reused buffers (a batch made in this
    process: a 38 MB batch stacked into fresh memory pays 9,400 page faults, ~5x the copy;
    runtime/recycle.py)."""

    def stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
        first = batch[0]
        large = (
            first.numel() * first.element_size() * len(batch) >= MIN_BYTES
        )  # else checking costs more
        if large and stackable(batch):
            return memory(batch)
        return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)

    return ColumnCollate(
        {**torch_collate.default_collate_fn_map, torch.Tensor: stack}, stackers=(stack,)
    )


class PlacingFetch:
    """torch's map-style fetcher of a batch made in this process with ``default_collate`` (its
    ``fetch(index)``), where each element's large tensors are copied to their row of the batch as
    soon as the element is fetched (:meth:`~torchpipe.runtime.recycle.RecycledStack.rows`, as the
    DSL's fused map and batch do), and an op that asks for its row
    (:func:`~torchpipe.runtime.recycle.batch_row`) writes there. torch's keeps every element
    until the collation stacks them: ``bigtensor``'s 64 elements of 600 KB, 38 MB that left the
    cache before the stack read them back. The batch is what ``collate_fn`` makes of the
    elements either way (the stack of placed rows is the batch they are already in)."""

    def __init__(
        self, dataset: Any, collate_fn: Callable[[list[Any]], Any], memory: RecycledStack
    ) -> None:
        self.dataset, self.collate_fn, self._memory = dataset, collate_fn, memory

    def fetch(self, index: list[Any]) -> Any:
        dataset = self.dataset
        data = []
        if not self._memory.placing():
            for idx in index:  # `idx`: the index an error names (_failed_index)
                data.append(dataset[idx])
            return self.collate_fn(data)
        with self._memory.rows(len(index)) as rows:
            for j, idx in enumerate(index):
                data.append(rows.place(j, dataset[idx]))
            return self.collate_fn(data)


class PlacingIterableFetch(torch_fetch._IterableDatasetFetcher):
    """torch's fetcher of an ``IterableDataset``'s batches (``num_workers=0``, batched by the
    loader, ``default_collate``) where, as in :class:`PlacingFetch`, each element's large tensors
    go to their row of the batch as the element comes; the end of the stream and ``drop_last``
    as torch's (a last, shorter batch is the first rows of its memory)."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any],
        drop_last: bool,
        memory: RecycledStack,
    ) -> None:
        super().__init__(dataset, True, collate_fn, drop_last)
        self._memory = memory

    def fetch(self, possibly_batched_index: list[Any]) -> Any:
        if self.ended or not self._memory.placing():
            return super().fetch(possibly_batched_index)
        wanted, data = len(possibly_batched_index), []
        with self._memory.rows(wanted) as rows:
            for j in range(wanted):
                try:  # the element is placed at once: no name keeps it while the next is made
                    data.append(rows.place(j, next(self.dataset_iter)))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < wanted):
                raise StopIteration
            return self.collate_fn(data)


def places(loader: DataLoader) -> bool:
    """Whether batches made here place their elements as they are fetched (:class:`PlacingFetch`):
    map-style, batched by the loader, with torch's ``default_collate``, and no ``__getitems__``
    (which fetches the batch's elements at once)."""
    return (
        loader._dataset_kind == torch_dataloader._DatasetKind.Map
        and loader._auto_collation
        and loader.collate_fn is torch_collate.default_collate
        and not getattr(loader.dataset, "__getitems__", None)
    )


def held_while_collated(collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``collate_fn``, where the first batch's elements (their tensors and arrays below glibc's
    largest mmap threshold, :data:`~torchpipe.runtime.heap.MAPPED_MAX`, besides their bytes and
    strings) size the heap this process keeps free between batches
    (:func:`~torchpipe.runtime.heap.hold_free`). The elements of a batch fetched here live until it
    is collated; glibc serves tensors of up to 32 MB from its heap once it freed a mapped one that
    large, and gave the freed elements back at every batch, to fault them in again at the next:
    ``bigtensor``'s 64 elements of 600 KB, 9,200 page faults a batch, 90-340 ms a batch inline on
    2 shared cores where the same batch took 10-20 ms with its elements' pages kept."""
    held = False

    def collate(elements: list[Any]) -> Any:
        nonlocal held
        if not held:
            held = True
            hold_free(heap_bytes(elements, MAPPED_MAX))
        return collate_fn(elements)

    return collate


def batch_seed(base_seed: int, epoch: int, batch: int) -> int:
    """The global RNGs' seed for batch ``batch`` of an epoch with ``num_workers="auto"``."""
    return mix_seed(base_seed, epoch, batch)


def fetch_seeded(
    seed: int, fetch: Callable[[Any], Any], index: Any, batch: int, replica: int | None = None
) -> Any:
    """:func:`fetch_noted` with ``tp.rng()`` seeded for the batch: the dataset's calls draw, in
    index order, from one generator seeded by ``seed`` (so ``tp.image``'s random ops give the same
    batch wherever it is made)."""
    prev = enter_call(seed, 0)
    try:
        return fetch_noted(fetch, index, batch, replica)
    finally:
        exit_call(prev)


def fetch_noted(
    fetch: Callable[[Any], Any], index: Any, batch: int, replica: int | None = None
) -> Any:
    """``fetch(index)``: an error it raises gets a note naming the DataLoader's batch and the
    dataset index that failed (or the batch's indices, or the IterableDataset replica)."""
    try:
        return fetch(index)
    except StopIteration:
        raise
    except Exception as e:
        where = (
            f"IterableDataset replica {replica}" if replica is not None else _failed_index(e, index)
        )
        add_note(e, f"raised in torchpipe stage DataLoader at batch {batch}, {where}")
        raise


def _failed_index(error: BaseException, index: Any) -> str:
    """Which index of the batch ``error`` came from: the one torch's fetcher was at when it was
    raised (read from the traceback, so no call pays for it), else the batch's indices."""
    if index is None or (isinstance(index, list) and all(i is None for i in index)):
        return "in the IterableDataset"  # its sampler yields no indices
    if not isinstance(index, list):
        return f"dataset index {index!r}"
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename in (torch_fetch.__file__, __file__) and "idx" in frame.f_locals:
            return f"dataset index {frame.f_locals['idx']!r}"
        tb = tb.tb_next
    shown = ", ".join(map(repr, index[:8])) + (
        f", ... ({len(index)} in all)" if len(index) > 8 else ""
    )
    return f"dataset indices [{shown}]"


class LoaderNext:
    """A mixin for torchpipe's DataLoader iterators, what their ``__next__`` adds to torch's:

    - torch's profiler span (its ``enumerate(DataLoader)#...`` record) is opened only while a
      profiler records (~5 us a batch, where a cheap batch costs tens). An IterableDataset's
      batches (torch checks their count against its length) and an epoch's first batch go
      through torch's own ``__next__``;
    - the first batch sizes the heap this process keeps free between batches
      (``runtime/heap.py``'s :func:`hold_free`), so that a batch's freed memory is not given back
      and faulted in again at every batch (rows with 64 KB ``bytes`` ran 5x slower so, made here
      or received from workers).
    """

    _sampler_iter: Any
    _dataset_kind: Any
    _num_yielded: int
    _heap_held = False

    def __next__(self) -> Any:
        if self._sampler_iter is None or self._dataset_kind != _MAP or _profiling():
            data = super().__next__()  # type: ignore[misc]
        else:
            data = self._next_data()  # type: ignore[attr-defined]
            self._num_yielded += 1
        if not self._heap_held:
            self._heap_held = True
            hold_free(heap_bytes(data))
        delivered(data)
        return data


_MAP = torch_dataloader._DatasetKind.Map
# a torch.profiler (or the autograd profiler) records
_profiling = torch._C._autograd._profiler_enabled


class Exhausted:
    """What a worker returns once its IterableDataset replica has ended (``on_replay``: it ended
    while a replacement worker replayed it, after ``on_replay`` batches)."""

    def __init__(self, on_replay: int | None = None) -> None:
        self.on_replay = on_replay


class FetchTask:
    """Runs in each worker: torch's worker set-up, then torch's fetcher for every batch.

    Seeds ``random``, torch and numpy exactly as torch's workers do (``base_seed + worker_id``),
    sets ``get_worker_info()``, calls ``worker_init_fn``, and makes the fetcher (for an
    IterableDataset, the worker's own replica): :class:`~torchpipe.loader.replicas.Replicas`
    does it, and runs the further replicas a batch may name (``num_workers="auto"`` over an
    IterableDataset). An error in that set-up is raised for every task, as torch does. With
    ``per_batch_seeds`` (``num_workers="auto"`` over a map-style dataset) the global RNGs are
    seeded again before each batch, from its index (:func:`batch_seed`).
    """

    def __init__(
        self, loader: DataLoader, base_seed: int, num_workers: int, per_batch_seeds: bool
    ) -> None:
        collate_fn = loader.collate_fn
        if collate_fn is torch_collate.default_collate:
            collate_fn = _collate_into_shared_memory
        kind, auto_collation, drop_last = (
            loader._dataset_kind,
            loader._auto_collation,
            loader.drop_last,
        )

        def make_fetcher(dataset: Any) -> Any:
            return torch_dataloader._DatasetKind.create_fetcher(
                kind, dataset, auto_collation, collate_fn, drop_last
            )

        # num_workers: what get_worker_info() says, the most workers (or replicas) there may be
        self.replicas = Replicas(
            loader.dataset, num_workers, base_seed, loader.worker_init_fn, make_fetcher
        )
        self.base_seed = base_seed
        self.per_batch_seeds = per_batch_seeds
        self.worker_id = 0

    def with_replicas(self, count: int) -> FetchTask:
        """The same task with ``count`` replicas (an IterableDataset's epoch started over with more)."""
        task = copy.copy(self)
        task.replicas = self.replicas.recount(count)
        return task

    def start_worker(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.replicas.start(worker_id)

    def __call__(self, seq: int, payload: tuple[Any, ...]) -> Any:
        # an IterableDataset's batch names its replica and its place in the replica's batches
        epoch, batch, index, *place = payload
        if self.per_batch_seeds:
            seed_global_rngs(batch_seed(self.base_seed, epoch, batch))
        replica, position = place if place else (self.worker_id, None)
        try:
            return fetch_seeded(
                batch_seed(self.base_seed, epoch, batch),
                lambda i: self.replicas.fetch(replica, epoch, i, position),
                index,
                batch,
                replica if place else None,
            )
        except StopIteration:
            return Exhausted()
        except EndedOnReplay as e:
            return Exhausted(on_replay=e.args[0])


class LocalFetch:
    """Fetches batches in this process, inline or on threads, as torch does with ``num_workers=0``.

    Inline, the global RNGs in ``rngs`` are seeded per batch as a worker seeds them, and the
    consumer's own states of them are put back afterwards (its dropout must not be reseeded).
    ``rngs`` are those the batches draw from, as measured: saving numpy's state costs ~90 us, so
    RNGs the dataset does not use are left alone. On threads nothing is seeded: the policy puts a
    fetch there only if it draws from none of them. With torch's ``default_collate``, large
    tensors are stacked into ``memory``'s reused buffers (:func:`recycling_collate`). The first
    batch's elements size the heap this process keeps free between batches
    (:func:`held_while_collated`).
    """

    def __init__(
        self, loader: DataLoader, base_seed: int, rngs: tuple[str, ...], memory: RecycledStack
    ) -> None:
        self.base_seed = base_seed
        self.rngs = rngs
        collate_fn = loader.collate_fn
        if collate_fn is torch_collate.default_collate:
            collate_fn = recycling_collate(memory)
        if loader._auto_collation:
            collate_fn = held_while_collated(collate_fn)
        self.fetcher: Any = (
            PlacingFetch(loader.dataset, collate_fn, memory)
            if places(loader)
            else torch_dataloader._DatasetKind.create_fetcher(
                loader._dataset_kind,
                loader.dataset,
                loader._auto_collation,
                collate_fn,
                loader.drop_last,
            )
        )

    def __call__(self, seq: int, payload: tuple[int, int, Any]) -> Any:
        epoch, batch, index = payload
        if not self.rngs:
            return fetch_seeded(
                batch_seed(self.base_seed, epoch, batch), self.fetcher.fetch, index, batch
            )
        saved = global_rng_states(self.rngs)
        try:
            return self.seeded(payload)
        finally:
            restore_global_rng_states(saved)

    def seeded(self, payload: tuple[int, int, Any]) -> Any:
        """Fetch with the RNGs seeded for the batch, and nothing put back."""
        epoch, batch, index = payload
        seed = batch_seed(self.base_seed, epoch, batch)
        return call_seeded(
            seed, fetch_seeded, seed, self.fetcher.fetch, index, batch, rngs=self.rngs
        )

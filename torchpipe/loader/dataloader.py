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
import multiprocessing
import operator
import sys
import warnings
import weakref
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import torch
import torch.utils.data._utils.collate as torch_collate
from torch.utils.data import dataloader as torch_dataloader
from torch.utils.data._utils.pin_memory import pin_memory

from torchpipe.autotune.report import PipelineStats
from torchpipe.dataset import Dataset
from torchpipe.errors import CheckpointError
from torchpipe.loader.collate import default_collate as column_collate
from torchpipe.loader.fetch import (
    LoaderNext,
    PlacingFetch,
    PlacingIterableFetch,
    fetch_seeded,
    places,
    recycling_collate,
)
from torchpipe.loader.rebuild import notice_read
from torchpipe.loader.replicas import MAX_REPLICAS
from torchpipe.loader.workers import WorkerIterator
from torchpipe.ops.device import DevicePrefetcher, check_device
from torchpipe.options import AutotuneOptions
from torchpipe.randomness import mix_seed, sampling_rng_state, set_sampling_rng_state
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.placement.measure import prepare_measurements
from torchpipe.runtime.processes.pool import process_executor_supported
from torchpipe.runtime.recycle import RecycledStack

_FORK = ("fork", None)
_TORCH_HAS_IN_ORDER = (
    "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters
)
_T_co = TypeVar("_T_co", covariant=True)
_TORCH_CONTEXT: Any = torch.utils.data.DataLoader.multiprocessing_context  # torch's property


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader``; see torch's documentation for the arguments.

    Args:
        num_workers: as torch's, or ``"auto"``: over a map-style dataset, batches are made in
            this process, on threads or on worker processes, wherever measured fastest, and the
            autotuner resizes a pool while it runs, between 1 and twice the cores (each batch goes
            to a free worker; they still arrive in sampler order;
            ``get_worker_info().num_workers`` is that most). Over an IterableDataset, twice the
            cores in replicas, on as many processes as the first batches say pay (torch's batches
            with that many workers); where those batches wait on I/O (slow storage), the first
            epoch starts over, before delivering anything, with 8 replicas a core (at most 64), a
            process each, and later epochs keep that count.
        device: ``None`` (batches stay on the CPU), or a device such as ``"cuda"``: batches
            arrive there, copied ahead through pinned memory on a side stream.
        autotune: what the tuner may use (``tp.AutotuneOptions``): ``ram_budget`` bounds what
            the loader holds of its own (the pages its worker processes and their zygote hold
            alone, and the rings batches travel in; default: half the memory available when the
            first epoch starts), read a few times a second. Past it, ``num_workers="auto"`` gives
            up workers down to one, then batches in flight, then the last worker (batches made
            here), then the zygote; an explicit ``num_workers`` is kept and warns once. With a
            ``ram_budget`` given rings hold at most a quarter of it. ``cpu_budget`` and
            ``enabled`` are the pipeline's.
        dataset: also a ``tp.Dataset`` pipeline, which runs in this process with its own
            parallel stages (``num_workers`` does not replicate it).
        (every other argument is torch's)

    Raises:
        ValueError, TypeError: where torch's DataLoader raises them; and, where torch raises only
            when the epoch starts: a TypeError for a ``dataset`` that is neither map-style (no
            ``__getitem__``) nor a torch ``IterableDataset`` (a generator, an int) and for a
            ``num_workers`` that is neither an int nor ``"auto"`` (``2.5``); a ValueError for a
            ``prefetch_factor`` of 0 with workers and a ``device`` that is not a usable device.
    """

    _tp: _LoaderState  # torchpipe's state, set through __dict__ (torch's __setattr__ guards attributes)

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
        autotune: AutotuneOptions | None = None,
    ) -> None:
        _check_arguments(dataset, num_workers, prefetch_factor, autotune)
        workers_auto = num_workers == "auto"
        # _check_workers refused any other str
        num_workers = usable_cpu_count() if workers_auto else cast(int, num_workers)
        newer = {"in_order": in_order} if _TORCH_HAS_IN_ORDER else {}
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            **newer,
        )
        if not _TORCH_HAS_IN_ORDER:
            self.in_order = in_order  # torch < 2.6 lacks it; torchpipe's workers honour it
        self.__dict__["_tp"] = _LoaderState(None if device is None else check_device(device))
        self._tp.workers_auto, self._tp.autotune = workers_auto, autotune or AutotuneOptions()
        if workers_auto:
            prepare_measurements()  # the machine's side of the first decision, before the first epoch

    @property
    def device(self) -> torch.device | None:
        """Where batches arrive (``None``: the CPU, as torch's DataLoader)."""
        return self._tp.device

    @property
    def multiprocessing_context(self) -> Any:
        """torch's; a read from a library that rebuilds loaders (Accelerate) warns once (loader/rebuild.py)."""
        notice_read(sys._getframe(1))
        return _TORCH_CONTEXT.fget(self)

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        _TORCH_CONTEXT.fset(self, context)

    def __iter__(self) -> Any:
        state = self._tp
        state.epoch_rng = sampling_rng_state(self.generator)
        iterator: Any = super().__iter__()  # torch's own logic, persistent workers included
        resume, state.resume = state.resume, None
        if resume:
            _skip(iterator, resume)
        if state.device is not None and state.device.type != "cpu":
            iterator = DevicePrefetcher(iterator, state.device, delivered=resume or 0)
        state.current = weakref.ref(iterator)
        return iterator

    def _get_iterator(self) -> Any:
        route = _route(self)
        return route(self) if route is not None else super()._get_iterator()

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch is: load it into a loader built the same way to get the rest.

        The state is the RNG state the epoch started from and how many batches it has yielded;
        resuming replays the epoch's sampling (no data is loaded) up to that point. It also holds
        what the batches depend on (the dataset's type and length, the batch size, the sampler),
        so that it is not loaded into a loader that would make other batches.
        """
        state = self._tp
        current = state.current() if state.current is not None else None
        if current is None:
            yielded = 0
        elif isinstance(current, DevicePrefetcher):
            yielded = current.delivered  # the copy thread runs ahead of what was handed over
        else:
            yielded = current._num_yielded
        return {
            "format": 2,
            "epoch_rng": state.epoch_rng,
            "yielded": yielded,
            "loader": _fingerprint(self),
        }

    def stats(self) -> PipelineStats:
        """The current epoch's stats; ``print()`` them for a report naming the bottleneck.

        For a ``tp.Dataset`` these are its pipeline's (every stage); for a map-style or iterable
        Dataset on workers, the workers' throughput, their time per batch and how long the
        training loop waited for batches. After a pass they describe it until the next starts.
        """
        current = self._tp.current() if self._tp.current is not None else None
        if isinstance(current, DevicePrefetcher):
            current = current._source
        if isinstance(current, _Reports):  # the iterator the epoch runs on says what it does
            return current.stats()
        # the last pass, once it is gone
        return self._tp.last_stats or PipelineStats([], 0.0, "", 0.0, [])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue the epoch ``state`` was taken in.

        Raises:
            CheckpointError: (a ``ValueError``) for something that is not a ``DataLoader.state_dict()``,
                or one taken from a loader that makes other batches (another dataset length,
                batch size, sampler, ...): it says what differs.
        """
        if not isinstance(state, dict) or state.get("format") not in (1, 2):
            raise CheckpointError("not a torchpipe DataLoader state (missing or unknown 'format')")
        yielded, rng = state.get("yielded"), state.get("epoch_rng")
        if not isinstance(yielded, int) or isinstance(yielded, bool) or yielded < 0:
            raise CheckpointError(
                f"DataLoader state: 'yielded' must be a count of batches, got {yielded!r}"
            )
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
            raise CheckpointError(
                f"DataLoader state: 'epoch_rng' must be a generator state (a uint8 tensor), got {type(rng).__name__}"
            )
        if "loader" in state:  # format 1 states carry no fingerprint: loaded on trust
            _adopt_replicas(self, state["loader"])
            _check_fingerprint(state["loader"], _fingerprint(self))
        length = _epoch_batches(self)
        if length is not None and yielded > length:
            raise CheckpointError(
                f"DataLoader state is at batch {yielded}, but this loader's epoch has {length} batches"
            )
        set_sampling_rng_state(self.generator, rng)
        self._tp.resume = yielded
        self._tp.epoch_rng = rng


class _LoaderState:
    """torchpipe's own attributes of a DataLoader (kept apart from torch's guarded ones)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.epoch_rng: Any = None
        self.current: weakref.ref | None = None
        self.resume: int | None = None
        self.workers_auto = False
        self.tuned_workers: int | None = None  # where num_workers="auto" left the worker count
        self.replicas: int | None = None  # and, over an IterableDataset, the replica count
        # and where it placed batches (a runtime.policy.Policy), for the next epoch
        self.policy: Any = None
        self.learned: dict[
            str, Any
        ] = {}  # the placement's windows, judged on from one epoch to the next
        self.autotune = AutotuneOptions()
        # what its workers hold against its budget (a loader.memory.LoaderMemory)
        self.memory: Any = None
        # the global RNGs its batches draw from, once measured
        self.drawn_rngs: tuple[str, ...] | None = None
        # the last pass on workers, after its iterator is gone
        self.last_stats: PipelineStats | None = None


def _route(loader: DataLoader) -> type[_PipelineIterator | WorkerIterator | _InlineIterator] | None:
    """The iterator class an epoch of ``loader`` runs on; None: torch's own (worker processes
    started by a spawn/forkserver context, which torchpipe's workers cannot fork)."""
    if isinstance(loader.dataset, Dataset):
        # A torchpipe pipeline runs its own parallel stages; replicating it into workers
        # would repeat its elements.
        return _PipelineIterator
    if loader.num_workers > 0 and _engine_can_run(loader):
        return WorkerIterator
    return _InlineIterator if loader.num_workers == 0 else None


@runtime_checkable
class _Reports(Protocol):
    """An iterator that reports its epoch's stats (``loader.stats()`` asks it)."""

    def stats(self) -> PipelineStats: ...


def _fingerprint(loader: torch.utils.data.DataLoader) -> dict[str, Any]:
    """What a loader's batches depend on, besides the RNG state an epoch starts from."""
    dataset = loader.dataset
    found: dict[str, Any] = {
        "dataset": type(dataset).__qualname__,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type(loader.sampler).__qualname__,
        "batch_sampler": None
        if loader.batch_sampler is None
        else type(loader.batch_sampler).__qualname__,
    }
    if isinstance(dataset, torch.utils.data.IterableDataset):
        # its replicas split it, so their number decides what each batch holds
        state: _LoaderState | None = loader.__dict__.get("_tp")
        if state is not None and _auto_replicas(loader):
            found["replicas"] = state.replicas or 2 * usable_cpu_count()
        else:
            found["replicas"] = loader.num_workers
    else:
        try:
            found["length"] = len(dataset)  # type: ignore[arg-type]  # no __len__: the TypeError below
        except TypeError:
            pass
    return found


def _adopt_replicas(loader: DataLoader, saved: Any) -> None:
    """``"auto"`` over an IterableDataset resumes with the replica count the state's epoch ran
    (its first epoch may have chosen more than it starts with)."""
    count = saved.get("replicas") if isinstance(saved, dict) else None
    if _auto_replicas(loader) and isinstance(count, int) and 1 <= count <= MAX_REPLICAS:
        loader._tp.replicas = count


def _auto_replicas(loader: torch.utils.data.DataLoader) -> bool:
    """Whether ``loader`` runs ``num_workers="auto"`` replicas of an IterableDataset (a torchpipe
    pipeline is not replicated)."""
    state: _LoaderState | None = loader.__dict__.get("_tp")
    dataset = loader.dataset
    iterable = isinstance(dataset, torch.utils.data.IterableDataset) and not isinstance(
        dataset, Dataset
    )
    return state is not None and state.workers_auto and iterable


def _check_fingerprint(saved: Any, here: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"DataLoader state: 'loader' must be a dict, got {type(saved).__name__}"
        )
    differs = [
        f"{key}: the state's {saved.get(key)!r}, this loader's {value!r}"
        for key, value in here.items()
        if saved.get(key) != value
    ]
    if differs:
        raise CheckpointError(
            "the DataLoader state was taken from a loader that makes other batches; "
            + "; ".join(differs)
        )


def _epoch_batches(loader: torch.utils.data.DataLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _check_arguments(
    dataset: Any, num_workers: Any, prefetch_factor: int | None, autotune: Any
) -> None:
    """Raise for what torch would take and fail on only when an epoch starts (a ``dataset`` or
    ``num_workers`` it cannot use, :func:`_check_dataset`, :func:`_check_workers`) and for an
    ``autotune`` that is not a tp.AutotuneOptions; warn where workers would go unused (a
    tp.Dataset runs its own parallel stages).

    Raises:
        TypeError, ValueError: as :class:`DataLoader` says.
    """
    _check_dataset(dataset)
    _check_workers(num_workers, prefetch_factor)
    if autotune is not None and not isinstance(autotune, AutotuneOptions):
        raise TypeError(
            f"autotune must be a tp.AutotuneOptions or None, got {type(autotune).__name__}"
        )
    if isinstance(dataset, Dataset) and isinstance(num_workers, int) and num_workers > 0:
        warnings.warn(
            f"num_workers={num_workers} is not used: a tp.Dataset runs its own parallel stages in "
            "this process (num_parallel_calls=..., or tp.AUTOTUNE); replicas in workers would "
            "repeat its elements",
            UserWarning,
            stacklevel=3,  # where the DataLoader is made
        )


def _check_dataset(dataset: Any) -> None:
    """Raise unless torch can read ``dataset``: an ``IterableDataset``, or map-style (indexable).

    A list, a string, a tensor or a numpy array is map-style, as torch takes it; a generator or
    another plain iterable is not (torch indexes it, and fails only when the epoch starts).

    Raises:
        TypeError: naming ``dataset`` and what was expected.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return
    if not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__getitems__"):
        hint = (
            " (wrap an iterable in a torch IterableDataset)" if hasattr(dataset, "__iter__") else ""
        )
        raise TypeError(
            "dataset must be a map-style dataset (with __getitem__) or a torch IterableDataset, "
            f"got {type(dataset).__name__}{hint}"
        )


def _check_workers(num_workers: Any, prefetch_factor: int | None) -> None:
    """Raise for a ``num_workers`` that is neither an int nor ``"auto"``, or a useless prefetch.

    What ``range()`` takes is an int, as for torch: a bool (``True`` is one worker), a numpy
    integer. A negative int is left to torch's own ValueError.

    Raises:
        TypeError: for a ``num_workers`` of another type (``2.5``, ``2.0``, ``None``).
        ValueError: for a string other than ``"auto"``, or ``prefetch_factor=0`` with workers.
    """
    if isinstance(num_workers, str):
        if num_workers != "auto":
            raise ValueError(
                f'num_workers must be a non-negative int or "auto", got {num_workers!r}'
            )
    elif not _is_index(num_workers):
        raise TypeError(
            f'num_workers must be a non-negative int or "auto", got {type(num_workers).__name__} '
            f"{num_workers!r}"
        )
    if prefetch_factor == 0 and num_workers != 0:
        raise ValueError(
            "prefetch_factor must be at least 1 with worker processes (batches each keeps in flight), got 0"
        )


def _is_index(value: Any) -> bool:
    """Whether ``value`` is an integer as ``range()`` takes one (torch's use of num_workers)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _engine_can_run(loader: DataLoader) -> bool:
    """Our workers fork; a ``spawn``/``forkserver`` context, given or set for the program with
    ``multiprocessing.set_start_method``, gets torch's own workers (as does a non-Linux system)."""
    context = loader.multiprocessing_context
    method = (
        context.get_start_method()
        if context is not None
        else multiprocessing.get_start_method(allow_none=True)
    )
    return process_executor_supported() and method in _FORK


def _skip(iterator: Any, count: int) -> None:
    """Advance a fresh iterator by ``count`` batches: map-style by sampling alone.

    Raises:
        CheckpointError: the epoch ends before ``count`` batches (the state is not this loader's).
    """
    try:
        if isinstance(iterator, WorkerIterator):
            iterator.skip(count)
            return
        for _ in range(count):
            if iterator._dataset_kind == torch_dataloader._DatasetKind.Map:
                iterator._next_index()
            else:
                iterator._next_data()
            iterator._num_yielded += 1
    except StopIteration:
        raise CheckpointError(
            f"the DataLoader state is at batch {count}, but this loader's epoch ends before it"
        ) from None


class _InlineIterator(LoaderNext, torch_dataloader._SingleProcessDataLoaderIter):
    """torch's iterator for ``num_workers=0``, whose errors name the batch and the index that failed;
    torch's ``default_collate`` runs a column at a time (loader/collate.py: the same batches), and
    where it can each element's large tensors go to their row of the batch as the element is
    fetched (:class:`~torchpipe.loader.fetch.PlacingFetch`, in memory reused once a batch is let go)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        if self._collate_fn is not torch_collate.default_collate:
            return  # a collate_fn of the user's: torch's fetcher as it is
        memory = RecycledStack()
        if places(loader):
            self._dataset_fetcher = PlacingFetch(self._dataset, recycling_collate(memory), memory)
        elif self._dataset_kind == torch_dataloader._DatasetKind.Iterable and self._auto_collation:
            self._dataset_fetcher = PlacingIterableFetch(
                self._dataset, recycling_collate(memory), self._drop_last, memory
            )
        else:
            self._dataset_fetcher = torch_dataloader._DatasetKind.create_fetcher(
                self._dataset_kind,
                self._dataset,
                self._auto_collation,
                column_collate,
                self._drop_last,
            )

    @classmethod
    def describe(cls, loader: DataLoader) -> list[str]:
        """How an epoch of ``loader`` runs, for ``tp.explain(loader)``."""
        fast = (
            " (default_collate a column at a time)"
            if loader.collate_fn is torch_collate.default_collate
            else ""
        )
        return [f"  torch's own iterator (num_workers=0){fast}"]

    def _next_data(self) -> Any:
        seed = mix_seed(int(self._base_seed), self._num_yielded)  # tp.rng() for the batch
        data = fetch_seeded(
            seed, self._dataset_fetcher.fetch, self._next_index(), self._num_yielded
        )
        return pin_memory(data, self._pin_memory_device) if self._pin_memory else data


class _PipelineIterator(torch_dataloader._BaseDataLoaderIter):
    """Batches from a ``tp.Dataset`` iterated in this process (whatever ``num_workers`` says)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._fetcher = self._make_fetcher()

    @classmethod
    def describe(cls, loader: DataLoader) -> list[str]:
        """How an epoch of ``loader`` runs, for ``tp.explain(loader)``: its pipeline's own plan."""
        lines = [
            "  the pipeline runs in this process with its own parallel stages (num_workers unused):"
        ]
        return lines + [
            "    " + line for line in cast(Dataset, loader.dataset).explain().splitlines()
        ]

    def _make_fetcher(self) -> Any:
        return torch_dataloader._DatasetKind.create_fetcher(
            self._dataset_kind,
            self._dataset,
            self._auto_collation,
            self._collate_fn,
            self._drop_last,
        )

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._fetcher = self._make_fetcher()  # a new epoch of the pipeline

    def _next_data(self) -> Any:
        data = self._fetcher.fetch(self._next_index())
        return pin_memory(data, self._pin_memory_device) if self._pin_memory else data

    def stats(self) -> PipelineStats:
        """The pipeline's stats (every stage), this epoch."""
        pipeline = getattr(self._fetcher, "dataset_iter", None)
        return pipeline.stats() if pipeline is not None else PipelineStats([], 0.0, "", 0.0, [])

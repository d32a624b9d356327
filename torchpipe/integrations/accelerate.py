"""Hugging Face Accelerate and transformers' Trainer, with batches from ``tp.DataLoader``.

Accelerate's ``prepare`` does not iterate the loader it is given: it builds a torch ``DataLoader``
from its attributes (inside a ``DataLoaderShard``), so a ``tp.DataLoader`` would be replaced.
:func:`use_torchpipe` makes an ``Accelerator`` keep it::

    accelerator = use_torchpipe(Accelerator())
    model, optimizer, loader = accelerator.prepare(model, optimizer, tp.DataLoader(..., num_workers="auto"))

How: Accelerate's own ``prepare_data_loader`` still runs (its sharding is the one used: the
``BatchSamplerShard`` it wraps around the loader's batch sampler, its seedable sampler, its
synchronized sampler generator), and the loader that comes back is a ``tp.DataLoader`` built with
the original's arguments and that batch sampler: :class:`AcceleratedDataLoader`. An
IterableDataset is read on every rank rather than dispatched from rank 0: a ``tp.Dataset``
pipeline splits itself (docs/distributed.md), another goes through Accelerate's
``IterableDatasetShard``.
``accelerator.save_state``/``load_state`` keep every rank's loader state and resume the epoch
exactly where it was. A Trainer takes :class:`TrainerMixin`. docs/integrations.md has the story.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist

try:
    from accelerate.data_loader import DataLoaderShard, DataLoaderStateMixin, IterableDatasetShard
    from accelerate.state import GradientState
    from accelerate.utils import synchronize_rng_states
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "torchpipe.integrations.accelerate needs accelerate: pip install 'torchpipe[accelerate]'"
    ) from e

from torchpipe.dataset import Dataset
from torchpipe.errors import CheckpointError
from torchpipe.loader import rebuild
from torchpipe.loader.dataloader import DataLoader, _LoaderState
from torchpipe.randomness import sampling_rng_state, set_sampling_rng_state

__all__ = ["AcceleratedDataLoader", "TrainerMixin", "use_torchpipe"]

_END = object()
STATE_FILE = "torchpipe_loader_{rank}.pt"
"""A Trainer checkpoint's loader state, one file a rank (:class:`TrainerMixin`)."""


class AcceleratedDataLoader(DataLoader, DataLoaderStateMixin):
    """A ``tp.DataLoader`` that plays the part of Accelerate's ``DataLoaderShard``.

    Made by :func:`use_torchpipe`'s ``prepare``, not by hand. Like Accelerate's loader it
    synchronizes the sampler's generator between ranks when an epoch starts, tells Accelerate's
    gradient accumulation which batch is the epoch's last (looking one batch ahead), and passes
    ``set_epoch`` to the sampler. Its ``state_dict()`` is a ``tp.DataLoader``'s plus the epoch number
    and the synchronized generator's state at the epoch's start; ``load_state_dict`` leaves the
    global RNGs as they are (Accelerate restored them) and replays the epoch's sampling when it
    starts.
    """

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        rng_types: list[Any] | None = None,
        synchronized_generator: torch.Generator | None = None,
        total_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.gradient_state = GradientState()
        self.end_of_dataloader, self.remainder = False, -1  # DataLoaderStateMixin's
        self._drop_last = self.drop_last
        self._total_batch_size = total_batch_size
        self.iteration = 0  # the epoch (DataLoaderShard's name)
        self._epoch = 0  # the epoch of the batches state_dict() counts
        self._ahead = 0  # 1 while a batch fetched to look ahead is not handed over yet
        self._sampler_rng: torch.Tensor | None = None
        # epoch, its RNG states
        self._pending: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    @property
    def total_batch_size(self) -> int:
        """The batch size over all ranks (Accelerate's meaning)."""
        return (
            self._total_batch_size if self._total_batch_size is not None else (self.batch_size or 1)
        )

    def get_sampler(self) -> Any:
        """The sampler under the batch sampler (Accelerate's checkpointing asks for it)."""
        holder = (
            self.sampler
            if isinstance(self.sampler, torch.utils.data.BatchSampler)
            else self.batch_sampler
        )
        return getattr(holder, "sampler", None)

    def set_sampler(self, sampler: Any) -> None:
        """Put ``sampler`` under the batch sampler (and the one it shards), as Accelerate's loader does."""
        holder: Any = (
            self.sampler
            if isinstance(self.sampler, torch.utils.data.BatchSampler)
            else self.batch_sampler
        )
        holder.sampler = sampler
        if hasattr(holder, "batch_sampler"):
            holder.batch_sampler.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass is: given to the sampler (or dataset) that takes one."""
        self.iteration = epoch
        batch_sampler = self.batch_sampler
        for holder in (batch_sampler, getattr(batch_sampler, "batch_sampler", None)):
            set_sampler_epoch = getattr(getattr(holder, "sampler", None), "set_epoch", None)
            if set_sampler_epoch is not None:
                set_sampler_epoch(epoch)
                return
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if set_dataset_epoch is not None:
            set_dataset_epoch(epoch)

    def __iter__(self) -> Any:
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.set_epoch(self.iteration)
        self._epoch = self.iteration
        batches = self._start()
        self.begin()
        try:
            current = next(batches, _END)
            while current is not _END:
                self._ahead = 1
                upcoming = next(batches, _END)
                if upcoming is _END:
                    self._ahead = 0
                    self.end_of_dataloader = True
                yield current
                current = upcoming
            self.iteration += 1
        finally:
            self._ahead = 0
            self.end()

    def _start(self) -> Any:
        """The epoch's iterator; a loaded state's epoch replays its sampling from the RNG states
        it started with, and leaves the global RNGs where they were (a restored checkpoint's)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] != self.iteration:
            # the state's epoch is not this one (it ended): this one starts afresh
            self._tp.resume = None
            pending = None
        generator = self.synchronized_generator
        if pending is not None and pending[2] is not None and generator is not None:
            generator.set_state(pending[2])
        self._sampler_rng = generator.get_state() if generator is not None else None
        if pending is None:
            return super().__iter__()
        keep = sampling_rng_state(self.generator)
        set_sampling_rng_state(self.generator, pending[1])
        try:
            return super().__iter__()
        finally:
            set_sampling_rng_state(self.generator, keep)

    def skip_next(self, count: int) -> None:
        """Start the next pass at batch ``count`` (Accelerate's ``skip_first_batches``): a loaded
        state's epoch is already there (the usual resume recipe calls both); otherwise the skipped
        batches' indices are drawn, not their data.

        Raises:
            ValueError: ``count`` is not where a loaded state resumes.
        """
        resume = self._tp.resume or 0
        if self._pending is not None and count not in (0, resume):
            raise ValueError(
                f"skip_first_batches({count}), but the loaded state resumes this epoch at batch {resume}"
            )
        if self._pending is None and count:
            self._tp.resume = count

    def state_dict(self) -> dict[str, Any]:
        """``tp.DataLoader.state_dict()``, counting the batches handed over, with the epoch and the
        synchronized sampler generator's state at its start."""
        state = super().state_dict()
        state["yielded"] -= self._ahead
        state["epoch"] = self._epoch
        if self._sampler_rng is not None:
            state["sampler_rng"] = self._sampler_rng
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass continue the epoch ``state`` was taken in; the RNGs are left alone.

        Raises:
            CheckpointError: as ``tp.DataLoader.load_state_dict``, or for a bad epoch or
                generator state.
        """
        epoch, sampler_rng = state.get("epoch", 0), state.get("sampler_rng")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise CheckpointError(
                f"DataLoader state: 'epoch' must be a non-negative int, got {epoch!r}"
            )
        if sampler_rng is not None and not (
            isinstance(sampler_rng, torch.Tensor) and sampler_rng.dtype == torch.uint8
        ):
            raise CheckpointError(
                "DataLoader state: 'sampler_rng' must be a generator state (a uint8 tensor)"
            )
        keep = sampling_rng_state(self.generator)
        super().load_state_dict(state)
        set_sampling_rng_state(self.generator, keep)  # set again when the epoch starts (_start)
        # taken after the epoch's last batch: the next one starts
        if state["yielded"] == _length(self):
            self._tp.resume = None
            self.iteration = self._epoch = epoch + 1
            self._pending = None
            return
        self.iteration = self._epoch = epoch
        self._pending = (epoch, state["epoch_rng"], sampler_rng)


class _RankStates:
    """What ``accelerator.save_state`` keeps of a loader: every rank's state, gathered (rank 0
    writes the file); ``load_state`` gives each rank its own."""

    def __init__(self, loader: AcceleratedDataLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        if not _distributed():
            return {"ranks": [state]}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)  # save_state runs on every rank
        return {"ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks") if isinstance(state, dict) else None
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        if not isinstance(ranks, list) or len(ranks) != world_size:
            count = len(ranks) if isinstance(ranks, list) else "no"
            raise CheckpointError(
                f"the checkpoint holds {count} ranks' loader states; this job has {world_size}"
            )
        self.loader.load_state_dict(ranks[rank])


def use_torchpipe(accelerator: Any, **loader_options: Any) -> Any:
    """Make ``accelerator.prepare`` keep ``tp.DataLoader``s; returns ``accelerator``.

    Each ``tp.DataLoader`` it prepares comes back as an :class:`AcceleratedDataLoader` with the
    same arguments (``num_workers="auto"``, ``device``, ...): over a map-style dataset its batch
    sampler is the one Accelerate's ``prepare_data_loader`` made (its sharding between ranks); a
    ``tp.Dataset`` pipeline splits itself between ranks (docs/distributed.md); batches go to
    ``accelerator.device`` through torchpipe's device prefetch where Accelerate would place them.
    Each is registered for checkpointing: ``save_state``/``load_state`` resume it mid-epoch.
    Other loaders are prepared as Accelerate prepares them.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        loader_options: ``tp.DataLoader`` arguments that also turn the plain torch loaders it
            prepares into torchpipe's (e.g. ``num_workers="auto"``); without them torch's stay torch's.
    """
    if not hasattr(accelerator, "_torchpipe_prepare"):
        accelerator._torchpipe_prepare = accelerator.prepare_data_loader  # Accelerate's, bound
        accelerator._torchpipe_skip = accelerator.skip_first_batches
    accelerator._torchpipe_options = loader_options
    accelerator.prepare_data_loader = types.MethodType(_prepare_data_loader, accelerator)
    accelerator.skip_first_batches = types.MethodType(_skip_first_batches, accelerator)
    return accelerator


def _skip_first_batches(accelerator: Any, dataloader: Any, num_batches: int = 0) -> Any:
    """``Accelerator.skip_first_batches``: a prepared ``tp.DataLoader`` is returned itself, its next
    pass starting at batch ``num_batches`` (where ``load_state`` put it already, or drawn afresh
    as Accelerate's skipping does); another loader is Accelerate's matter."""
    if not isinstance(dataloader, AcceleratedDataLoader):
        return accelerator._torchpipe_skip(dataloader, num_batches)
    dataloader.skip_next(num_batches)
    return dataloader


def _prepare_data_loader(
    accelerator: Any,
    data_loader: Any,
    device_placement: bool | None = None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``Accelerator.prepare_data_loader``, keeping (or making) a ``tp.DataLoader``."""
    prepare, options = accelerator._torchpipe_prepare, accelerator._torchpipe_options
    ours = isinstance(data_loader, DataLoader) or (
        options and type(data_loader) is torch.utils.data.DataLoader
    )
    if not ours or getattr(data_loader, "_is_accelerate_prepared", False):
        return prepare(data_loader, device_placement, *args, **kwargs)
    place = accelerator.device_placement if device_placement is None else device_placement
    dataset = data_loader.dataset
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if isinstance(dataset, Dataset) or (
        iterable and getattr(accelerator, "dispatch_batches", None) is None
    ):
        # Accelerate would read it on rank 0 only
        pieces = _iterable_pieces(accelerator, data_loader)
        device = accelerator.device if place else None
    else:
        with rebuild.expected():
            prepared = prepare(data_loader, device_placement, *args, **kwargs)
        if not isinstance(prepared, DataLoaderShard):
            warnings.warn(_dispatched(prepared), UserWarning, stacklevel=3)
            return prepared
        pieces = _shard_pieces(data_loader, prepared)
        device = getattr(prepared, "device", None)
        _forget(accelerator, prepared)
    return _accelerated_loader(accelerator, pieces, _loader_arguments(data_loader, options), device)


def _dispatched(prepared: Any) -> str:
    """The warning for a loader that Accelerate prepared as one that dispatches batches."""
    return (
        f"Accelerate prepared this loader as a {type(prepared).__name__} (dispatch_batches=True?): "
        "its batches come from torch's DataLoader; DataLoaderConfiguration(dispatch_batches=False) "
        "keeps torchpipe's"
    )


def _accelerated_loader(
    accelerator: Any, pieces: dict[str, Any], arguments: dict[str, Any], device: Any
) -> AcceleratedDataLoader:
    """The loader made of ``pieces`` and ``arguments``, putting batches on ``device`` (where it is
    not the CPU and the original loader named none), tracked and checkpointed by ``accelerator``."""
    if arguments["device"] is None and device is not None and torch.device(device).type != "cpu":
        arguments["device"] = device
    loader = AcceleratedDataLoader(**pieces, **arguments)
    if hasattr(accelerator, "_dataloaders"):
        accelerator._dataloaders.append(loader)
    accelerator.register_for_checkpointing(_RankStates(loader))
    return loader


def _iterable_pieces(accelerator: Any, loader: torch.utils.data.DataLoader) -> dict[str, Any]:
    """An IterableDataset read on every rank: a ``tp.Dataset`` splits itself; another is split as
    Accelerate splits it without dispatching (``IterableDatasetShard``: each rank its slice of
    every ``world_size`` batches)."""
    world_size, batch_size = accelerator.num_processes, loader.batch_size
    split = bool(getattr(accelerator, "split_batches", False)) and not isinstance(
        loader.dataset, Dataset
    )
    dataset = loader.dataset
    if world_size > 1 and not isinstance(dataset, Dataset):
        dataset = IterableDatasetShard(
            dataset,
            batch_size=batch_size or 1,
            drop_last=loader.drop_last,
            num_processes=world_size,
            process_index=accelerator.process_index,
            split_batches=split,
        )
    total = batch_size if split or batch_size is None else batch_size * world_size
    if split and batch_size is not None:
        batch_size //= world_size
    return {
        "dataset": dataset,
        "batch_size": batch_size,
        "drop_last": loader.drop_last,
        "total_batch_size": total,
    }


def _shard_pieces(original: torch.utils.data.DataLoader, prepared: Any) -> dict[str, Any]:
    """The dataset and batch sampler of Accelerate's prepared loader, with its rank plumbing."""
    pieces: dict[str, Any] = {
        "dataset": prepared.dataset,
        "rng_types": prepared.rng_types,
        "synchronized_generator": prepared.synchronized_generator,
        "total_batch_size": prepared.total_batch_size,
    }
    if isinstance(prepared.dataset, torch.utils.data.IterableDataset):
        pieces.update(batch_size=prepared.batch_size, drop_last=original.drop_last)
    elif (
        isinstance(prepared.sampler, torch.utils.data.BatchSampler)
        and prepared.batch_size is not None
    ):
        # a batch sampler given as sampler
        pieces.update(sampler=prepared.sampler, batch_size=prepared.batch_size)
    else:
        pieces["batch_sampler"] = prepared.batch_sampler
    return pieces


def _loader_arguments(
    loader: torch.utils.data.DataLoader, options: dict[str, Any]
) -> dict[str, Any]:
    """The arguments ``loader`` was made with, besides its data and batching, and ``options``."""
    state: _LoaderState | None = loader.__dict__.get("_tp")
    arguments: dict[str, Any] = {
        "num_workers": "auto" if state is not None and state.workers_auto else loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": getattr(loader, "in_order", True),
        "device": state.device if state is not None else None,
        "autotune": state.autotune if state is not None else None,
    }
    if state is None:
        arguments.update(options)  # a torch loader made torchpipe's
    if arguments["num_workers"] == 0:
        arguments.update(
            prefetch_factor=None, persistent_workers=False, multiprocessing_context=None
        )
    return arguments


def _forget(accelerator: Any, prepared: Any) -> None:
    """Drop Accelerate's own prepared loader (never iterated) from the loaders it tracks."""
    tracked = getattr(accelerator, "_dataloaders", None)
    if isinstance(tracked, list):
        tracked[:] = [loader for loader in tracked if loader is not prepared]


class TrainerMixin:
    """Mix into a ``transformers.Trainer``: its training batches come from a ``tp.DataLoader``.

    ``class MyTrainer(TrainerMixin, Trainer): ...``. The loader the Trainer makes (its sampler,
    collator, batch size) is made a ``tp.DataLoader`` with ``torchpipe_loader_options`` (by
    default ``num_workers="auto"``), and a ``tp.DataLoader`` that an overridden
    ``get_train_dataloader`` prepares is kept as it is. Each checkpoint holds every rank's loader
    state (``torchpipe_loader_<rank>.pt``), and ``train(resume_from_checkpoint=...)`` resumes the
    epoch from it exactly, instead of the Trainer's skipping (Accelerate's ``skip_first_batches``,
    which runs the resumed epoch on a torch loader): ``ignore_data_skip`` is set for that call.
    """

    torchpipe_loader_options: dict[str, Any] = {"num_workers": "auto"}  # noqa: RUF012 - read only

    accelerator: Any
    args: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._torchpipe_resume: str | None = None
        use_torchpipe(self.accelerator)  # a tp.DataLoader the Trainer is given to prepare is kept
        self.add_callback(_checkpoint_callback()(self))  # type: ignore[attr-defined]

    def get_train_dataloader(self) -> Any:
        use_torchpipe(self.accelerator, **self.torchpipe_loader_options)
        try:
            return super().get_train_dataloader()  # type: ignore[misc]
        finally:
            self.accelerator._torchpipe_options = {}  # evaluation loaders stay torch's

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        # an overridden get_train_dataloader's tp.DataLoader is kept too
        use_torchpipe(self.accelerator)
        folder = resume_from_checkpoint
        if folder is True:
            from transformers.trainer_utils import get_last_checkpoint

            folder = get_last_checkpoint(self.args.output_dir)
        skip = self.args.ignore_data_skip
        if isinstance(folder, str) and os.path.exists(
            os.path.join(folder, STATE_FILE.format(rank=0))
        ):
            self._torchpipe_resume = folder
            # the loader resumes itself (the callback's on_train_begin)
            self.args.ignore_data_skip = True
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self.args.ignore_data_skip = skip
            self._torchpipe_resume = None


_CALLBACK: type | None = None


def _checkpoint_callback() -> type:
    """The ``TrainerCallback`` that saves and loads the loader's state (transformers imported on use)."""
    global _CALLBACK
    if _CALLBACK is not None:
        return _CALLBACK
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class LoaderCheckpoints(TrainerCallback):
        """Each rank's loader state into each checkpoint; a resumed run's loader from it."""

        def __init__(self, trainer: TrainerMixin) -> None:
            self.trainer = trainer

        def on_train_begin(
            self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
        ) -> None:
            folder = self.trainer._torchpipe_resume
            if folder is not None and isinstance(train_dataloader, AcceleratedDataLoader):
                path = os.path.join(folder, STATE_FILE.format(rank=args.process_index))
                train_dataloader.load_state_dict(
                    torch.load(path, map_location="cpu", weights_only=True)
                )

        def on_save(
            self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
        ) -> None:
            if isinstance(train_dataloader, AcceleratedDataLoader):
                folder = os.path.join(
                    args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
                )
                os.makedirs(folder, exist_ok=True)
                path = os.path.join(folder, STATE_FILE.format(rank=args.process_index))
                torch.save(train_dataloader.state_dict(), path)

    _CALLBACK = LoaderCheckpoints
    return _CALLBACK


def _length(loader: torch.utils.data.DataLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

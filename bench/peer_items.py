"""What every peer's pipeline computes and how it hands its batches over (``bench/peers.py``,
``bench/tfdata.py``): the workload's item function as ``Items``, a library's grid point as
``PeerConfig``, its iterator with a ``close()`` as ``PeerIterator``, its epochs on one loader as
``PeerEpochs``, and a batch of indices as one task (``BatchOf``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bench import workloads as wl

STOP_TIMEOUT_S = 10.0
"""How long stopping a peer's pipeline may take (its threads and processes) before giving up."""
ITEM_TIMEOUT_S = 120.0
"""How long a peer may take to hand over one batch (worker start-up included) before failing."""


@dataclass(frozen=True)
class Items:
    """What every peer's pipeline computes: ``fn(i)`` for ``i < length``, batched by ``collate``.

    Attributes:
        fn: the workload's own item function (a picklable module-level callable).
        length: how many indices (an epoch; 10**7 where the measurement never reaches the end).
        batch_size: the workload's batch size.
        collate: the workload's collation (torch's ``default_collate`` unless it has its own).
        fan_out: 0, or the most items one ``fn(i)`` returns as a list (``latency``: a shard's
            records), flattened before batching.
    """

    fn: Callable[[int], Any]
    length: int
    batch_size: int
    collate: Callable[[list[Any]], Any]
    fan_out: int = 0


@dataclass
class PeerConfig:
    """One point of a library's grid.

    Attributes:
        knobs: the library's settings, as the report shows them.
        make: builds the pipeline and returns its iterator of batches (``measure()``'s ``make``).
        name: set for a point reported on its own (a zero-knob setting, a native pipeline).
        in_best: whether the point competes for ``<library>_best`` (a native pipeline does
            other work, so it does not).
        epochs: builds the pipeline as a loader run epoch after epoch (an epochs workload's
            ``measure_epochs()``'s ``make``); None where the adapter has none.
    """

    knobs: dict[str, Any]
    make: Callable[[], Iterator[Any]]
    name: str | None = None
    in_best: bool = True
    epochs: Callable[[], PeerEpochs] | None = None


class PeerIterator:
    """A peer's iterator with the ``close()`` that ``measure()`` calls to stop its workers.

    Args:
        iterator: the library's iterator of batches.
        stop: stops the library's threads and processes.
        convert: applied to each batch (tf.data's tensors to torch's, without a copy).
    """

    def __init__(
        self,
        iterator: Iterator[Any],
        stop: Callable[[], None] = lambda: None,
        convert: Callable[[Any], Any] | None = None,
    ) -> None:
        self._iterator, self._stop, self._convert = iterator, stop, convert

    def __iter__(self) -> PeerIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        return batch if self._convert is None else self._convert(batch)

    def close(self) -> None:
        """Stop the pipeline now (idempotent)."""
        stop, self._stop = self._stop, lambda: None
        stop()


class PeerEpochs:
    """A peer's pipeline as a loader run epoch after epoch: each ``iter()`` is one epoch.

    What the epochs share (a library's dataset, a process pool the library lets a user keep)
    is made once, before the first; ``epoch()`` starts one pass over it; ``close()`` stops what
    they share. Where a library cannot keep its workers from one epoch to the next, ``epoch()``
    starts them again, as a user's loop over its epochs would.

    Args:
        epoch: starts one epoch and returns its iterator (its ``close()`` ends the epoch).
        stop: stops what the epochs share.
    """

    def __init__(
        self, epoch: Callable[[], PeerIterator], stop: Callable[[], None] = lambda: None
    ) -> None:
        self._epoch, self._stop = epoch, stop

    def __iter__(self) -> PeerIterator:
        return self._epoch()

    def close(self) -> None:
        """Stop what the epochs share (idempotent)."""
        stop, self._stop = self._stop, lambda: None
        stop()


def one_pass(build: Callable[[], PeerEpochs]) -> PeerIterator:
    """The first epoch of ``build()``'s loader, whose ``close()`` also closes the loader: a timed
    workload's pipeline (its epoch long enough never to end)."""
    loader = build()
    try:
        iterator = iter(loader)
    except BaseException:
        loader.close()
        raise

    def stop() -> None:
        try:
            iterator.close()
        finally:
            loader.close()

    return PeerIterator(iterator, stop)


class BatchOf:
    """Indices to one collated batch of ``fn``'s items: a worker process's task, so one transfer
    carries a batch (as DataLoader's workers and torchpipe's fused map+batch do)."""

    def __init__(self, fn: Callable[[int], Any], collate: Callable[[list[Any]], Any]) -> None:
        self.fn, self.collate = fn, collate

    def __call__(self, indices: list[int]) -> Any:
        return self.collate([self.fn(i) for i in indices])


class ShardRecords:
    """``latency``'s item for the peers: shard ``i % len(paths)`` read whole by the workload's
    reader (its 5 ms per request included), as a list of ``(features, label)`` records."""

    def __init__(self, paths: list[str], reader: wl.ShardReader) -> None:
        self.paths, self.reader = paths, reader

    def __call__(self, i: int) -> list[tuple[torch.Tensor, int]]:
        return list(self.reader(self.paths[i % len(self.paths)]))


def items_of(work: wl.Workload) -> Items:
    """The workload's item function, length, batch size and collation, as every peer maps them.

    Raises:
        TypeError: for a workload whose dataset is neither map-style (``Mapped``) nor ``Shards``.
    """
    collate = work.collate_fn or torch.utils.data.default_collate
    dataset = work.dataset
    if isinstance(dataset, wl.Mapped):
        return Items(dataset.fn, len(dataset), work.batch_size, collate)
    if isinstance(dataset, wl.Shards):
        undelayed = ShardRecords(
            dataset.paths, wl.ShardReader(0.0, dataset.reader.records_per_read)
        )
        most = max(len(undelayed(i)) for i in range(len(dataset.paths)))
        return Items(
            ShardRecords(dataset.paths, dataset.reader),
            10**7,
            work.batch_size,
            collate,
            fan_out=most,
        )
    raise TypeError(
        f"workload {work.name!r}: no peer adapter for a {type(dataset).__name__} dataset"
    )


def grid_of(work: wl.Workload, quick: bool) -> list[tuple[int, str]]:
    """The ``(parallelism, "thread" | "process")`` points every library is tried at: the workload's
    own ``tp_grid`` without its inline point; ``quick``, only its most threads and fewest processes
    (the points ``torchpipe_best`` picks most often, so the run stays short)."""
    points = [(n, executor) for n, executor in work.tp_grid if n is not None]
    if not quick:
        return points
    threads = [n for n, executor in points if executor == "thread"]
    processes = [n for n, executor in points if executor == "process"]
    quick_points = [(max(threads), "thread")] if threads else []
    return quick_points + ([(min(processes), "process")] if processes else [])

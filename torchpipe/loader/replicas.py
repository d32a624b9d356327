"""``num_workers="auto"`` over an IterableDataset: replicas of the dataset, placed on worker processes.

An IterableDataset is split by its replicas: each runs ``iter(dataset)`` with ``get_worker_info()``
naming its id and how many replicas there are, and yields its share. So their number cannot change
while an epoch runs, and a replica cannot move once it has started (its position lives in the
process that runs it). With ``"auto"`` an epoch starts with twice the usable cores in replicas
(what ``get_worker_info().num_workers`` says, as for a map-style dataset), the first ones on a
process each, and holds their first batches until they say where the rest run, by the runtime's
policy (:func:`~torchpipe.runtime.placement.policy.workers`): where batches mostly wait (slow storage), a
process a replica, as many reads in flight as replicas; else a process a core, each running its
replicas in turn. On a loader's first epoch, batches that wait on I/O also ask for more replicas
(:func:`io_replicas`, as many worker processes as the RAM budget holds): nothing has been
delivered yet, so the epoch starts over with that many (the held batches are dropped and made
again by the new replicas' shares), and the loader keeps the count for its later epochs and in
its ``state_dict()``.

Every replica is set up as torch sets up a worker (its seeds, ``worker_init_fn``, its own
``WorkerInfo``) and keeps its own global RNG states, swapped in whenever its process turns to it.
Batches are taken from the replicas in torch's order (batch ``k`` from replica ``k % n``, skipping
ended ones), so an epoch gives the batches of torch's DataLoader with ``num_workers`` = the
replicas, wherever each one runs.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.worker as torch_worker

from torchpipe.randomness import global_rng_states, restore_global_rng_states
from torchpipe.runtime.placement.costs import THREAD, CallCosts, workers

MakeFetcher = Callable[[Any], Any]
"""``make_fetcher(dataset)``: torch's fetcher over ``dataset`` (for an IterableDataset, a fresh replica iterator)."""


class EndedOnReplay(Exception):
    """A replica started again in a replacement worker ended before the batch it was asked for."""


class _Replica:
    __slots__ = ("info", "fetcher", "epoch", "fetched", "rngs", "init_error")

    def __init__(self, info: Any) -> None:
        self.info = info
        self.fetcher: Any = None
        self.epoch = 0
        self.fetched = 0  # its batches fetched this epoch
        self.rngs: dict[str, Any] | None = None  # its global RNG states while another replica runs
        self.init_error: BaseException | None = None


class Replicas:
    """The replicas one worker process runs, each with its own ``WorkerInfo`` and global RNG states.

    Args:
        dataset: the loader's dataset (a replica other than the process's first gets a shallow
            copy of it as it was before any ``worker_init_fn`` ran, so one that sets attributes on
            ``get_worker_info().dataset`` from their values, as torch's documentation shows,
            sets them for its replica alone, from the dataset's own).
        count: how many replicas the epoch has (``get_worker_info().num_workers``).
        base_seed: the epoch's base seed; replica ``r`` is seeded ``base_seed + r``, as torch's worker ``r``.
        worker_init_fn: called once per replica, with its id, after its seeding.
        make_fetcher: builds a replica's fetcher over its dataset.
    """

    def __init__(
        self,
        dataset: Any,
        count: int,
        base_seed: int,
        worker_init_fn: Any,
        make_fetcher: MakeFetcher,
    ) -> None:
        self._dataset = dataset
        self.count = count
        self._base_seed = base_seed
        self._worker_init_fn = worker_init_fn
        self._make_fetcher = make_fetcher
        self._pristine = dataset  # a copy of the dataset as given: the copies of later replicas
        self._open: dict[int, _Replica] = {}
        self._current: _Replica | None = None

    def recount(self, count: int) -> Replicas:
        """Replicas of the same dataset, ``count`` of them (none started)."""
        return Replicas(
            self._dataset, count, self._base_seed, self._worker_init_fn, self._make_fetcher
        )

    def start(self, replica: int) -> None:
        """Set up ``replica`` now (a worker's own one, at the worker's start, as torch does)."""
        self._switch_to(None)
        seed = self._base_seed + replica
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(torch_worker._generate_state(self._base_seed, replica))
        if not self._open and self.count > 1:  # before a worker_init_fn sets the first one up
            self._pristine = copy.copy(self._dataset)
        dataset = self._dataset if not self._open else copy.copy(self._pristine)
        entry = _Replica(
            torch_worker.WorkerInfo(id=replica, num_workers=self.count, seed=seed, dataset=dataset)
        )
        self._open[replica] = entry
        self._current = entry
        torch_worker._worker_info = entry.info
        try:
            if self._worker_init_fn is not None:
                self._worker_init_fn(replica)
            entry.fetcher = self._make_fetcher(dataset)
        except Exception as e:  # noqa: BLE001 - raised for each of its batches, like torch's workers
            entry.init_error = e

    def fetch(self, replica: int, epoch: int, index: Any, position: int | None = None) -> Any:
        """The next batch of ``replica``, its ``position``-th of the epoch where given
        (``StopIteration`` once it has ended).

        A replica started in a replacement worker (its predecessor died) is asked for a later
        batch than its first: the batches before it, which the dead worker made and the loader
        delivered, are made again and dropped, so none is delivered twice. That holds for a
        replica that yields the same elements on every run from its seeds, as torch's workers
        seed them.

        Raises:
            Exception: what setting the replica up raised, for each of its batches.
            EndedOnReplay: the replayed replica ended before ``position`` (fine where it had
                ended there before too; the loader, which knows, tells the two apart).
            RuntimeError: the replica was asked to go back to a batch before one it has made.
        """
        if replica not in self._open:
            self.start(replica)
        entry = self._open[replica]
        self._switch_to(entry)
        if entry.init_error is not None:
            raise entry.init_error
        if entry.epoch != epoch:  # a persistent worker's next epoch: a fresh replica iterator
            entry.epoch, entry.fetched = epoch, 0
            entry.fetcher = self._make_fetcher(entry.info.dataset)
        if position is not None:
            self._replay(replica, entry, index, position)
        batch = entry.fetcher.fetch(index)
        entry.fetched += 1
        return batch

    @staticmethod
    def _replay(replica: int, entry: _Replica, index: Any, position: int) -> None:
        if position < entry.fetched:
            raise RuntimeError(
                f"IterableDataset replica {replica} was asked for its batch {position} "
                f"after making {entry.fetched}: a replica cannot go back"
            )
        while entry.fetched < position:
            try:
                entry.fetcher.fetch(index)
            except StopIteration:
                raise EndedOnReplay(entry.fetched) from None
            except Exception:  # noqa: BLE001 - that batch's error was delivered by the dead worker
                pass
            entry.fetched += 1

    def _switch_to(self, entry: _Replica | None) -> None:
        current = self._current
        if current is entry:
            return
        if current is not None:
            current.rngs = global_rng_states()
        if entry is not None:
            if entry.rngs is not None:
                restore_global_rng_states(entry.rngs)
            torch_worker._worker_info = entry.info
        self._current = entry


MAX_REPLICAS = 64
"""The most replicas ``"auto"`` runs (each waiting replica on a process of its own)."""


def io_replicas(cores: int) -> int:
    """The replicas an epoch whose batches wait on I/O runs: 8 a core, at most :data:`MAX_REPLICAS`.

    One count, not one measured: the count decides what each batch holds, and a measured one
    (cores x wall/CPU) changed from run to run with the machine's load, so two runs of one
    script gave other batches. A replica waiting 10-20x its CPU time wants more; 8 a core keeps
    the cores busy from 8x on (``latency``, 2 cores: 16 replicas 47k records/s, 32 46k).
    """
    return min(MAX_REPLICAS, 8 * cores)


class ReplicaPlan:
    """How many replicas an epoch runs and which worker process runs each: replica ``r`` on
    process ``r`` for the first ones, and, once :meth:`decide` has seen what their first batches
    cost, on process ``r % processes``.

    Args:
        replicas: the replicas the epoch starts with.
        processes: the processes the epoch starts with (the first replicas', one each).
        decided: a process count an earlier epoch decided (no need to wait for measurements).
        fixed: whether ``replicas`` is final (an earlier epoch, or a resumed state, decided it);
            if not, the first decision may ask for more replicas where batches mostly wait.
    """

    def __init__(
        self, replicas: int, processes: int, decided: int | None = None, fixed: bool = False
    ) -> None:
        self.replicas = replicas
        self.processes = min(decided or processes, replicas)
        self.decided = decided is not None
        self.fixed = fixed or self.decided

    def host(self, replica: int) -> int | None:
        """The process slot that runs ``replica``; None until that is decided."""
        if replica < self.processes:
            return replica
        return replica % self.processes if self.decided else None

    def decide(
        self, calls: int, wall_s: float, cpu_s: float, cores: int, room: int = MAX_REPLICAS
    ) -> int | None:
        """How many processes the replicas run on, from what ``calls`` batches cost their workers;
        or, where the count is not fixed and batches mostly wait, how many replicas the epoch
        should start over with: :func:`io_replicas`, one a process (as many reads in flight as
        replicas), at most ``room`` (the worker processes the RAM budget holds; the replicas
        there are where the waits may be another process's use of the cores).

        Returns:
            None where the plan stands (``processes`` is decided), else the replica count to start over with.
        """
        costs = CallCosts(wall_s / calls, cpu_s / calls, 1.0, 0.0, most=MAX_REPLICAS)
        # the rule for calls on threads (each call's waits overlap the others'): a core each, or
        # cores x wall/CPU where they wait, not capped at twice the cores as a process pool is
        wanted = workers(costs, THREAD, cores)
        more = min(io_replicas(cores), room)
        if not self.fixed and wanted > self.replicas and more > self.replicas:
            return more
        self.processes = max(self.processes, min(wanted, self.replicas))
        self.decided = self.fixed = True
        return None

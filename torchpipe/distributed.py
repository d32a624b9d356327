"""Distributed input: which rank this is, the seed all ranks share, their agreement on the end
of a pass, which files a shard reads, and resharding checkpoints for another number of ranks.

A pipeline iterated where ``torch.distributed`` is initialized with a world size above 1 (or
``tp.DistributeOptions(rank=..., world_size=...)`` says so) yields this rank's share; the graph
rewrite that places the shard is ``graph/distribute.py`` and docs/distributed.md tells the whole
story. Collectives run only in a rank's own process (never in a torch DataLoader worker), each
with a bounded wait.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data._utils.worker as torch_worker

from torchpipe.errors import CheckpointError
from torchpipe.ops.distribute import SHARD_STATE_KEYS, ReplicaShard
from torchpipe.ops.sources import SplitFileList
from torchpipe.options import DistributeOptions

__all__ = ["Replica", "current_replica", "current_shard", "reshard_states", "shard_files"]


# -- which torch DataLoader worker this is, and whether the user's code asked ---------------------
def worker_info() -> Any:
    """torch's ``WorkerInfo`` of this DataLoader worker (or ``tp.DataLoader`` replica), or None.

    The one place torchpipe reads it: through torch's module, not ``get_worker_info()``, so that
    only the user's calls count as asking (:func:`split_by_hand`).
    """
    return torch_worker._worker_info


_ASKED: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
"""What code outside torch and torchpipe did in a worker, by its info's id: ``[info, how, read]``,
``how`` being ``"asked"`` which worker it is or ``"split"`` its files, ``read`` whether a pass
has read it (from then on it is fixed: what code inside that pass asks is no split by hand). The
info is kept so that its id is not reused (torch's WorkerInfo takes no weak reference); a few
hundred at most."""
_ASKED_KEEP = 256
_ASKED_LOCK = threading.Lock()


def note_split_by_hand(info: Any, how: str = "asked") -> None:
    """Note that the user's code in worker ``info`` learned which worker it is (``how="asked"``:
    ``torch.utils.data.get_worker_info()``) or took its share of files (``"split"``:
    :func:`shard_files`), so it may have split, or has split, its data by hand. Once a pass in
    the worker has read what was noted (:func:`split_by_hand`), it no longer changes."""
    with _ASKED_LOCK:
        entry = _ASKED.get(id(info))
        if entry is None or entry[0] is not info:
            _ASKED[id(info)] = [info, how, False]
        elif not entry[2] and entry[1] != "split":
            entry[1] = how
        while len(_ASKED) > _ASKED_KEEP:
            _ASKED.popitem(last=False)


def split_by_hand(info: Any) -> str:
    """What code outside torch and torchpipe did in worker ``info`` before its first pass started:
    ``"split"``, ``"asked"`` or "" (calls made while a pipeline runs there, by a dataset's
    ``__getitem__`` or a map's function, are not a split by hand)."""
    with _ASKED_LOCK:
        entry = _ASKED.get(id(info))
        if entry is None or entry[0] is not info:
            entry = _ASKED[id(info)] = [info, "", True]
        entry[2] = True
        return entry[1]


def _noted_get_worker_info(info: Any) -> None:
    if not sys._getframe(2).f_globals.get("__name__", "").startswith(("torch.", "torchpipe.")):
        note_split_by_hand(info)  # not torch's own (default_collate asks) nor torchpipe's


def _get_worker_info() -> Any:  # the body torch's get_worker_info() runs (see _watch_get_worker_info)
    if _worker_info is not None:  # noqa: F821 - a global of torch's worker module, where this runs
        _torchpipe_noted_get_worker_info(_worker_info)  # noqa: F821
    return _worker_info  # noqa: F821


def _watch_get_worker_info() -> bool:
    """Make ``torch.utils.data.get_worker_info()`` note the user's calls, wherever it was imported.

    ``from torch.utils.data import get_worker_info`` binds torch's function before torchpipe is
    imported, so replacing the name would miss it: the function's code is swapped instead, for one
    that returns exactly what torch's does and notes the caller (code in torch and torchpipe is not
    counted: default_collate asks too). Only done where torch's function is the one-line reader
    this expects; returns whether it was.
    """
    fn = torch_worker.get_worker_info
    code, ours = fn.__code__, _get_worker_info.__code__
    if code.co_names not in (("_worker_info",), ours.co_names) or code.co_argcount:
        return False  # another torch's reader: leave it alone
    torch_worker._torchpipe_noted_get_worker_info = _noted_get_worker_info
    names = {key: getattr(code, key) for key in ("co_name", "co_qualname", "co_filename") if hasattr(code, key)}
    fn.__code__ = ours.replace(**names)
    return True


WATCHING_GET_WORKER_INFO = _watch_get_worker_info()
"""Whether the user's calls of ``get_worker_info()`` are noted: where they are not, torchpipe cannot
tell whether code that iterates a pipeline in a worker split its data by hand, and warns."""

DEFAULT_WAIT_S = 1800.0
"""How long a collective waits for the other ranks where ``Options.stall_timeout`` is None."""


@dataclasses.dataclass(frozen=True)
class Replica:
    """This process as one of several ranks.

    Attributes:
        rank: its rank.
        world_size: the number of ranks.
        connected: whether it may talk to the other ranks (``torch.distributed`` is initialized
            and this is a rank's own process, not a torch DataLoader worker forked from one).
    """

    rank: int
    world_size: int
    connected: bool


def current_replica(options: DistributeOptions | None = None) -> Replica | None:
    """The rank this process is, or None where a pipeline is not split between ranks.

    ``options.rank`` and ``options.world_size`` win over ``torch.distributed``'s; ``policy="off"``
    or a ``torch.distributed`` world of one rank is no split (an explicit ``world_size=1`` is a
    split of one, which loads states resharded for one rank).
    """
    options = options if options is not None else DistributeOptions()
    if options.policy == "off":
        return None
    group = _group_rank()
    if options.rank is not None:
        rank, world = options.rank, options.world_size
    elif group is not None:
        rank, world = group
    else:
        return None
    if world <= 1 and options.rank is None:
        return None
    connected = group is not None and group[1] > 1 and worker_info() is None
    return Replica(rank, world, connected)


def _group_rank() -> tuple[int, int] | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def current_shard(options: DistributeOptions | None = None) -> ReplicaShard | None:
    """This process's share of a split stream: its rank x its torch DataLoader worker, or None
    where there is neither."""
    replica = current_replica(options)
    info = worker_info()
    workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
    if replica is None and workers <= 1:
        return None
    rank, world = (replica.rank, replica.world_size) if replica is not None else (0, 1)
    return ReplicaShard(world, rank, workers, worker)


def shard_files(files: Sequence[str], shard: ReplicaShard | None = None) -> list[str]:
    """The files that ``shard`` reads: the split ``policy="file"`` makes, for any reader.

    Ranks take the files in turn (file ``i`` to rank ``i % world_size``), and a rank's files go
    to its torch DataLoader workers in turn, so every file is read by exactly one shard and a
    rank reads the same files with or without workers. This is the list form of the split a
    pipeline's rank shard makes (``ReplicaShard.owns``); in a pipeline, mark the names with
    ``tp.io.split_files`` instead, which splits them when each pass starts. A pipeline that
    starts from the list returned (``tp.from_tensor_slices``, a ``torchpipe.io`` reader) is split
    by hand: it is not split again, between ranks or between torch DataLoader workers.

    Args:
        files: every file, in the order all shards agree on.
        shard: which share; default :func:`current_shard` (all the files where there is none).

    Raises:
        ValueError: where there are fewer files than ranks x workers (one would read nothing).
    """
    if shard is None:
        shard = current_shard()
        if shard is not None and shard.num_workers > 1:
            note_split_by_hand(worker_info(), "split")  # this worker's code split its data: not again
    if shard is None:
        return list(files)
    if len(files) < shard.shards:
        raise ValueError(shard.too_few_files(len(files)))
    return SplitFileList((name for i, name in enumerate(files) if shard.owns(i)), shard)



# -- talking to the other ranks -------------------------------------------------------------------
def broadcast_seed(seed: int, wait_s: float | None) -> int:
    """Rank 0's ``seed``, on every rank (a collective on the default group)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    work = dist.broadcast(value, src=0, async_op=True)
    _wait(work, wait_s, "rank 0's seed for the pass (every rank iterates the pipeline, or give it tp.Options(seed=...))")
    return int(value.item())


class PassGroup:
    """The ranks' agreement for one pass, on a gloo process group of its own.

    A pass whose ranks' lengths are not known ahead agrees at every element whether to go on;
    its own group keeps those collectives apart from the training loop's (DDP's on the default
    group) and from other passes' (a validation pass beside a training one).

    Args:
        wait_s: how long a collective waits for the other ranks (None: 30 minutes).
    """

    def __init__(self, wait_s: float | None) -> None:
        self._wait_s = wait_s
        self._group: Any = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closing = False

    def open(self) -> None:
        """Make the group; every rank calls it, in the same order as its other groups."""
        if self._group is not None or self._closing:
            raise RuntimeError("a pass's agreement is opened once")
        timeout = datetime.timedelta(seconds=self._wait_s or DEFAULT_WAIT_S)
        self._group = dist.new_group(backend="gloo", timeout=timeout)

    def all(self, value: bool) -> bool:
        return self._reduce(value, dist.ReduceOp.MIN)

    def any(self, value: bool) -> bool:
        return self._reduce(value, dist.ReduceOp.MAX)

    def _reduce(self, value: bool, op: Any) -> bool:
        with self._lock:
            if self._group is None or self._closing:
                raise RuntimeError("the ranks' agreement is closed (the pass was closed)")
            group = self._group
            self._in_flight += 1
        try:
            flag = torch.tensor([int(value)], dtype=torch.int32)
            _wait(dist.all_reduce(flag, op=op, group=group, async_op=True), self._wait_s,
                  "the other ranks to agree whether the pass goes on (do all ranks iterate it?)")  # fmt: skip
            return bool(flag.item())
        finally:
            with self._lock:
                self._in_flight -= 1
                last = self._closing and not self._in_flight
            if last:
                self._destroy()

    def close(self) -> None:
        """Drop the group, now or, where a collective is still waiting on it, when that ends
        (destroying a group under a waiting collective would wait with it)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            waiting = self._in_flight
        if not waiting:
            self._destroy()

    def _destroy(self) -> None:
        with self._lock:
            group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # the default group went first: nothing left to drop
                pass


def _wait(work: Any, wait_s: float | None, what: str) -> None:
    seconds = wait_s or DEFAULT_WAIT_S
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        raise RuntimeError(f"rank {dist.get_rank()} waited up to {seconds:g} s for {what}: {e}") from e


# -- elastic resume -----------------------------------------------------------------------------------
_ABOVE = {"equalize", "map", "filter", "batch", "padded_batch", "ignore_errors", "to_device"}
"""Ops that may sit above the rank shard of a pipeline whose states reshard: none holds elements
between two of its outputs, so what a rank consumed is what its shard passed."""
_BELOW = {"shuffle", "take", "skip", "repeat", "shard", "from_dataset", "range", "from_tensor_slices"}
"""Ops that may sit below it: an index source and the ops that only reorder or select its
elements, which every rank runs alike (the same state at the same position)."""
_LOG_KEYS = {"input", "seq", "skip"}
_EQUALIZE_KEYS = {"input", "yielded", "wraps"}


def reshard_states(states: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Checkpoints of one epoch taken on N ranks, converted for ``world_size`` ranks.

    Each new rank resumes the epoch without an element of it being lost or repeated: the
    elements any old rank had are left out, and the rest are split between the new ranks as a
    fresh epoch would split them. The pipeline must be split with ``level='data'`` over an index
    source (``from_dataset``, ``range``, ``from_tensor_slices``, after ``shuffle``/``take``/
    ``skip``/``repeat``) and hold no elements above the split (``map``, ``filter``, ``batch``,
    ``padded_batch``, ``ignore_errors``, ``to_device`` and prefetches; parallel maps in order).

    Args:
        states: ``state_dict()`` of every old rank's pass (one each, in any order), taken at
            the same step as far as the training loop goes.
        world_size: the new number of ranks.

    Returns:
        The state for each new rank, by rank: rank ``r`` loads ``result[r]`` into ``iter(ds)``.

    Raises:
        CheckpointError: for states that are not one epoch of every old rank of one pipeline, or
            of a pipeline that cannot be resharded (the message says why).
        ValueError: for a ``world_size`` below 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"reshard_states: world_size must be an int >= 1, got {world_size!r}")
    olds = _old_shards(states)
    origin, holes = olds[0].shard["origin"], set(olds[0].shard["holes"])
    resume = min(old.shard["position"] for old in olds)
    world = len(olds)
    had = {q for q in holes if q >= resume}
    for old in olds:
        had.update(old.own_positions(resume, origin, holes, world))
    base = next(old for old in olds if old.shard["position"] == resume)
    return [base.for_rank(rank, world_size, resume, sorted(had)) for rank in range(world_size)]


@dataclasses.dataclass
class _OldShard:
    """One old rank's state, with the path to its shard's."""

    state: dict[str, Any]
    path: list[Any]
    shard: dict[str, Any]

    def own_positions(self, start: int, origin: int, holes: set[int], world: int) -> list[int]:
        """The input positions at or past ``start`` whose elements this rank had."""
        rank, end = self.shard["rank"], self.shard["position"]
        eligible = start - origin - sum(1 for q in holes if q < start)
        own = []
        for q in range(start, end):
            if q in holes:
                continue
            if eligible % world == rank:
                own.append(q)
            eligible += 1
        return own

    def for_rank(self, rank: int, world_size: int, resume: int, holes: list[int]) -> dict[str, Any]:
        state = copy.deepcopy(self.state)
        parent, node = state, state["pipeline"]
        for key in self.path:
            if isinstance(node, dict) and _EQUALIZE_KEYS <= set(node):
                node["yielded"], node["wraps"] = 0, 0  # the new ranks' passes are as long as each other's
            parent, node = node, node[key]
        shard = dict(input=node["input"], position=resume, world_size=world_size, rank=rank, num_workers=1,
                     worker=0, origin=resume, holes=holes, pad=[], padded=False)  # fmt: skip
        parent[self.path[-1] if self.path else "pipeline"] = shard
        return state


def _old_shards(states: Sequence[dict[str, Any]]) -> list[_OldShard]:
    if isinstance(states, dict) or not isinstance(states, Sequence) or not states:
        raise CheckpointError("reshard_states: expected a list of the old ranks' states")
    olds = []
    for i, state in enumerate(states):
        if not isinstance(state, dict) or state.get("format") != 3 or "pipeline" not in state:
            raise CheckpointError(f"reshard_states: states[{i}] is not a torchpipe pipeline state (format 3)")
        paths = list(_shard_paths(state["pipeline"], []))
        if len(paths) != 1:
            raise CheckpointError(f"reshard_states: states[{i}] has {len(paths)} rank shards; it must have one "
                                  "(a pipeline split between ranks, from a rank's own process)")  # fmt: skip
        shard = _follow(state["pipeline"], paths[0])
        olds.append(_OldShard(state, paths[0], shard))
    _check_same_epoch(olds)
    _check_ops(olds[0].state["ops"])
    for old in olds:
        _check_nothing_held(old)
    return sorted(olds, key=lambda old: old.shard["rank"])


def _shard_paths(node: Any, path: list[Any]) -> Any:
    if isinstance(node, dict):
        if set(SHARD_STATE_KEYS) <= set(node):
            yield path
            return
        for key, value in node.items():
            yield from _shard_paths(value, path + [key])
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _shard_paths(value, path + [i])


def _follow(node: Any, path: list[Any]) -> Any:
    for key in path:
        node = node[key]
    return node


def _check_same_epoch(olds: list[_OldShard]) -> None:
    first = olds[0]
    for key in ("ops", "seed", "epoch"):
        if any(old.state.get(key) != first.state.get(key) for old in olds):
            raise CheckpointError(f"reshard_states: the states differ in {key!r}: they are not one pass of one pipeline")
    worlds = {old.shard["world_size"] for old in olds}
    ranks = sorted(old.shard["rank"] for old in olds)
    if worlds != {len(olds)} or ranks != list(range(len(olds))):
        raise CheckpointError(f"reshard_states: expected one state from each of the old ranks; got ranks {ranks} "
                              f"of world sizes {sorted(worlds)}")  # fmt: skip
    if any(old.shard["num_workers"] != 1 for old in olds):
        raise CheckpointError("reshard_states: states taken in torch DataLoader workers cannot be resharded")
    for key in ("origin", "holes"):
        if any(old.shard[key] != first.shard[key] for old in olds):
            raise CheckpointError(f"reshard_states: the states' shards differ in {key!r}: not one pass")
    if any(not isinstance(old.shard["position"], int) for old in olds):
        raise CheckpointError("reshard_states: a shard's 'position' is not an int")


def _check_ops(ops: Any) -> None:
    written = ops[: ops.index("->")] if isinstance(ops, list) and "->" in ops else None
    lines = [line for line in written or [] if line.startswith("distribute(")]
    if written is None or len(lines) != 1:
        raise CheckpointError("reshard_states: the states' 'ops' do not name one rank shard")
    at = written.index(lines[0])
    if "level='data'" not in lines[0]:
        raise CheckpointError(f"reshard_states: the pipeline is split as {lines[0]}; only level='data' (the "
                              "elements of an index source) reshards")  # fmt: skip
    for line, allowed, where in ((written[:at], _ABOVE, "above"), (written[at + 1 :], _BELOW, "below")):
        for op in line:
            if op.split("(", 1)[0] not in allowed:
                raise CheckpointError(f"reshard_states: {op} {where} the rank shard holds or makes elements a "
                                      f"resharded rank could not take over; allowed {where} it: {sorted(allowed)}")  # fmt: skip


def _check_nothing_held(old: _OldShard) -> None:
    node: Any = old.state["pipeline"]
    for key in old.path:
        if isinstance(node, dict) and _LOG_KEYS <= set(node) and node["skip"]:
            raise CheckpointError(
                f"reshard_states: rank {old.shard['rank']}'s parallel map delivered elements out of order "
                "(deterministic=False); reshard states taken with deterministic=True"
            )
        if isinstance(node, dict) and _EQUALIZE_KEYS <= set(node) and node["wraps"]:
            raise CheckpointError(
                f"reshard_states: rank {old.shard['rank']} was already padding the end of its epoch with repeated "
                "elements: nothing is left to reshard; start the next epoch on the new ranks instead"
            )
        node = node[key]


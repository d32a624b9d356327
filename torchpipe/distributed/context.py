"""Who this process is: its rank (``torch.distributed``'s, or ``DistributeOptions``'), its torch
DataLoader worker, and whether the user's code there asked which worker it is.

The one place torchpipe reads torch's worker info (:func:`worker_info`) and the process group.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
from typing import Any

import torch.distributed as dist
import torch.utils.data._utils.worker as torch_worker

from torchpipe.distributed.nodes import Share
from torchpipe.options import DistributeOptions


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
    ``tp.distributed.share_of_files``), so it may have split, or has split, its data by hand. Once a pass in
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


# the body torch's get_worker_info() runs (see _watch_get_worker_info)
def _get_worker_info() -> Any:
    if _worker_info is not None:  # type: ignore[name-defined]  # noqa: F821 - a global of torch's worker module, where this runs
        _torchpipe_noted_get_worker_info(_worker_info)  # type: ignore[name-defined]  # noqa: F821
    return _worker_info  # type: ignore[name-defined]  # noqa: F821


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
    torch_worker._torchpipe_noted_get_worker_info = _noted_get_worker_info  # type: ignore[attr-defined]
    names = {
        key: getattr(code, key)
        for key in ("co_name", "co_qualname", "co_filename")
        if hasattr(code, key)
    }
    fn.__code__ = ours.replace(**names)
    return True


WATCHING_GET_WORKER_INFO = _watch_get_worker_info()
"""Whether the user's calls of ``get_worker_info()`` are noted: where they are not, torchpipe cannot
tell whether code that iterates a pipeline in a worker split its data by hand, and warns."""


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """This process as one of several ranks (what torch's ``WorkerInfo`` is for a worker).

    Attributes:
        rank: its rank.
        world_size: the number of ranks.
        connected: whether it may talk to the other ranks (``torch.distributed`` is initialized
            and this is a rank's own process, not a torch DataLoader worker forked from one).
    """

    rank: int
    world_size: int
    connected: bool


def current_rank_info(options: DistributeOptions | None = None) -> RankInfo | None:
    """The rank this process is, or None where a pipeline is not split between ranks.

    ``options.rank`` and ``options.world_size`` win over ``torch.distributed``'s; ``policy="off"``
    or a ``torch.distributed`` world of one rank is no split (an explicit ``world_size=1`` is a
    split of one, which loads states resharded for one rank).
    """
    options = options if options is not None else DistributeOptions()
    if options.policy == "off":
        return None
    group = _group_rank()
    # given together (DistributeOptions)
    if options.rank is not None and options.world_size is not None:
        rank, world = options.rank, options.world_size
    elif group is not None:
        rank, world = group
    else:
        return None
    if world <= 1 and options.rank is None:
        return None
    connected = group is not None and group[1] > 1 and worker_info() is None
    return RankInfo(rank, world, connected)


def _group_rank() -> tuple[int, int] | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def current_share(options: DistributeOptions | None = None) -> Share | None:
    """This process's share of a split stream: its rank x its torch DataLoader worker, or None
    where there is neither."""
    rank = current_rank_info(options)
    info = worker_info()
    workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
    if rank is None and workers <= 1:
        return None
    index, world = (rank.rank, rank.world_size) if rank is not None else (0, 1)
    return Share(world, index, workers, worker)

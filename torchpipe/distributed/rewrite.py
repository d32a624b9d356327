"""The distribution rewrite: a pipeline split for the rank and the torch DataLoader worker this
process is, decided in one place before the static passes (``graph/plan.py`` runs them on its
result).

Three cases, one function (:func:`distribute`):

- on one of several ranks: the rank split (``distributed/ranks.py``), which also splits the
  rank's share between its torch workers where it runs in one;
- in a torch worker and no rank: the worker split (``distributed/workers.py``), unless the
  pipeline or the code that iterates it split the data by hand;
- otherwise the pipeline as written.
"""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.distributed.context import RankInfo
from torchpipe.distributed.ranks import Distribution, split_for_rank
from torchpipe.distributed.workers import TorchWorker, split_between_workers, split_for_worker
from torchpipe.options import Options


def distribute(
    root: Node, options: Options, worker: TorchWorker | None, rank: RankInfo | None
) -> Distribution:
    """``root`` split for this process: its ``rank`` (None: not split between ranks) and its torch
    ``worker`` (None: not in one).

    Raises:
        ValueError: for distribution options this pipeline cannot run with (``distributed/ranks.py``).
    """
    policy, uneven = options.distribute.policy, options.distribute.uneven
    place = (rank.rank, rank.world_size) if rank is not None else (0, 1)
    split = split_between_workers(root, worker, policy, place) if worker is not None else None
    splitting = worker if split is not None and split.automatic else None
    notes = [split.note] if split is not None and split.note else []
    warning = (
        split.warning if split is not None and worker is not None and worker.index == 0 else None
    )
    if rank is not None:
        by_hand = split.shards if split is not None else ()
        distribution = split_for_rank(
            root, options.distribute, rank, splitting, options.stall_timeout, by_hand
        )
        distribution.notes.extend(notes)
        distribution.warning = warning
        return distribution
    if splitting is not None:
        written, note = split_for_worker(root, splitting.num_workers, splitting.index)
        return Distribution(written, written, [note], False, (), uneven, warning=warning)
    return Distribution(root, root, notes, False, (), uneven, warning=warning)

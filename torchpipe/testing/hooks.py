"""White-box hooks into a running pass: its stages, knobs, placement, measured costs and worker
processes, so that tests steer what the policy and the autotuner would without reaching into
private state. ``torchpipe.testing`` hands every one of them on.

Each hook goes through the seam that the object it steers documents for tests
(:meth:`~torchpipe.graph.plan.PipelineIterator.tree`,
:func:`~torchpipe.runtime.placement.measure.forced_costs`,
:meth:`~torchpipe.runtime.placement.placement.Placement.never_moving`, a DataLoader iterator's
``stage``, ``placement`` and ``process_pool``, ...); only :func:`start_as_measured` still writes a
DataLoader's state itself (marked ``loader:``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torchpipe.autotune import tunable
from torchpipe.autotune.live import walk_iterators
from torchpipe.graph.plan import PipelineIterator
from torchpipe.loader.workers import WorkerIterator
from torchpipe.ops.interleave.iterator import InterleaveIterator
from torchpipe.ops.prefetch import PrefetchIterator
from torchpipe.runtime.placement import measure
from torchpipe.runtime.placement.costs import CallCosts
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.processes.pool import ProcessPool


def stages(iterator: Any) -> list[Any]:
    """The stages of a running pass, root first, depth first: the op iterators of ``iter(ds)``
    once it yielded an element (or loaded a state), or the workers' stage of a DataLoader's
    iterator.

    Raises:
        AssertionError: if the pass has not started (nothing built yet).
    """
    if isinstance(iterator, WorkerIterator):
        return [iterator.stage]
    root = iterator.tree if isinstance(iterator, PipelineIterator) else iterator
    if root is None:
        raise AssertionError("the pass has not started: take an element first")
    return [stage for stage, _ in walk_iterators(root)]


def find_stage(iterator: Any, kind: type) -> Any:
    """The first stage (root first) of a running pass that is a ``kind``; see :func:`stages`.

    Raises:
        AssertionError: if there is none.
    """
    for stage in stages(iterator):
        if isinstance(stage, kind):
            return stage
    raise AssertionError(
        f"no {kind.__name__} among the stages {[type(s).__name__ for s in stages(iterator)]}"
    )


def knobs(iterator: Any) -> list[Any]:
    """Every AUTOTUNE knob (``LiveKnob``) of a running pass or DataLoader iterator, root first:
    ``knob.request(n)`` is what the autotuner does (applied before the next element)."""
    return [knob for stage in stages(iterator) for knob in tunable.knobs(stage)]


def move_calls(iterator: Any, kind: str, workers: int) -> None:
    """Force a placement: from now on run the calls of the first stage of ``iterator`` placed by
    the policy (``executor="auto"``, ``num_workers="auto"``) on ``kind`` (``"inline"``,
    ``"thread"`` or ``"process"``) with ``workers`` threads or processes, as the policy's and the
    tuner's decisions do. Later decisions may move them again.

    Raises:
        AssertionError: if no stage of ``iterator`` is placed by a policy.
    """
    for placement in _placements(iterator):
        if placement is not None and placement.policy is not None:
            placement.move(kind, workers)
            return
    raise AssertionError(
        "no stage of this pass is placed by a policy (executor='auto', num_workers='auto')"
    )


def keep_calls(iterator: Any) -> None:
    """Play a window whose verdict keeps the calls of the first stage of ``iterator`` placed by
    the policy where they run now (what a judged window that stays does: a process pool the
    calls left lets its workers and zygote go, the heap threads left is given back).

    Raises:
        AssertionError: if no stage of ``iterator`` is placed by a policy.
    """
    for placement in _placements(iterator):
        if placement is not None and placement.policy is not None:
            placement.stayed()
            return
    raise AssertionError(
        "no stage of this pass is placed by a policy (executor='auto', num_workers='auto')"
    )


def _placements(iterator: Any) -> list[Placement | None]:
    """The placement of each stage of a running pass (None for a stage without one)."""
    if isinstance(iterator, WorkerIterator):
        return [iterator.placement]
    return [getattr(stage, "placement", None) for stage in stages(iterator)]


@contextlib.contextmanager
def forced_call_costs(
    call_s: float,
    gil_free: float,
    cpu_s: float | None = None,
    move_s: float = 1e-6,
    moves: bool = True,
) -> Iterator[None]:
    """Within the block, the first calls that every auto-placed stage measures (a map's or
    interleave's ``executor="auto"``, ``DataLoader(num_workers="auto")``, and the first batches of
    an IterableDataset's replicas there) cost this much, whatever the machine's load: the first
    placement (and replica count) is then the policy's answer to these costs.

    The calls still run (inline, delivered in their places); only what they are measured to cost
    is replaced. A stage measures when it starts: a map at its first element, a DataLoader's
    iterator when it is made (``iter(loader)``); both belong in the block.

    Args:
        call_s: the wall time of one call, in seconds.
        gil_free: the share of a call during which the GIL is free (0: pure Python; 1: waits
            or GIL-releasing native code).
        cpu_s: the CPU time of one call (default: ``call_s``).
        move_s: the time to move one result between processes.
        moves: whether the windows judged within the block may move the calls on (the measured
            windows are the machine's, loaded or not); False: stages made in the block stay
            where these costs placed them, so a test can assert where that is.
    """
    costs = CallCosts(call_s, call_s if cpu_s is None else cpu_s, gil_free, move_s)
    with contextlib.ExitStack() as forced:
        forced.enter_context(measure.forced_costs(costs))
        if not moves:  # no verdict is ever agreed on: nothing moves on a prediction
            forced.enter_context(Placement.never_moving())
        yield


def zygote_pids(iterator: Any) -> list[int]:
    """The pids of the zygotes (the processes worker processes are forked from) that the process
    pools of a running pass or DataLoader iterator hold now."""
    return [
        pid
        for pool in _process_pools(iterator)
        for pid in sorted(set(pool.process_ids) - set(worker_pids(pool)))
    ]


def worker_pids(pool: ProcessPool) -> list[int]:
    """The pids of every worker process a ``ProcessPool`` holds, retiring ones too."""
    return [pid for pid in pool.process_ids if pid != pool.zygote_pid]


def worker_rings(pool: ProcessPool) -> list[list[Any]]:
    """The shared-memory rings (``ShmRing``) of each worker of a ``ProcessPool``, as mapped in
    this process, in the order the worker added them."""
    return list(pool.worker_rings)


def ring_slots(iterator: Any) -> list[int]:
    """The slots of each worker's rings in use (its newest ring and its spare) in the process
    pools a running pass or DataLoader iterator holds: the results the worker may have in flight
    and held at once."""
    return [
        sum(ring.slots for ring in rings if not ring.closed)
        for pool in _process_pools(iterator)
        for rings in worker_rings(pool)
        if any(not ring.closed for ring in rings)
    ]


def _process_pools(iterator: Any) -> list[ProcessPool]:
    """The process pools the stages of a running pass or a DataLoader's iterator hold now."""
    pools: list[Any] = []
    if isinstance(iterator, WorkerIterator):
        pools = [iterator.process_pool]
    else:
        pools = [getattr(stage, "process_pool", None) for stage in stages(iterator)]
    return [pool for pool in pools if isinstance(pool, ProcessPool)]


def node(dataset: Any) -> Any:
    """The logical node (``torchpipe.core.node.Node``) at the root of ``dataset``, as written."""
    return dataset._node  # the package's own handle on a Dataset's node, as sources.py reads it


def running_node(dataset: Any) -> Any:
    """The root node of ``dataset`` as it will run: after the shard rewrites and the optimizer's
    passes (what ``explain()`` prints under "As it will run")."""
    return dataset._plan().runtime_root  # as Dataset.cardinality() reads it


def open_readers(iterator: Any) -> list[Any]:
    """The open readers of the first interleave stage of a running pass: those in the cycle's
    slots, then those opened ahead of them, in input order."""
    return list(find_stage(iterator, InterleaveIterator).open_readers)


def release_readers(iterator: Any, readers: list[Any]) -> list[Any]:
    """Release ``readers`` (see :func:`open_readers`) from their pool, as a move to another
    executor does first; their places (``ReaderPlace``), with what each had read ahead."""
    return list(find_stage(iterator, InterleaveIterator).reader_pool.release(readers))


def reader_capacity(iterator: Any) -> int:
    """The items one reader of the first interleave stage of a running pass may hold ready or
    in flight now (its read-ahead)."""
    return int(find_stage(iterator, InterleaveIterator).reader_pool.reader_capacity())


def start_as_measured(loader: Any, processes: int | None, replicas: int | None = None) -> None:
    """Have a ``DataLoader(num_workers="auto")`` start its next epoch where an earlier epoch's
    measurements left it: on ``processes`` worker processes (None: measure afresh) and, over an
    IterableDataset, with ``replicas`` replicas (None: as many as it would start with).

    Raises:
        AssertionError: if ``loader`` is not a ``tp.DataLoader`` with ``num_workers="auto"``.
    """
    state = loader.__dict__.get("_tp")  # loader: no public seam yet
    if state is None or not state.workers_auto:
        raise AssertionError("start_as_measured() takes a tp.DataLoader with num_workers='auto'")
    state.tuned_workers, state.replicas = processes, replicas


def leave_prefetch_in(iterator: Any, mode: str) -> None:
    """Have the first ``prefetch(tp.AUTOTUNE)`` of a running pass take ``mode`` (``"inline"``:
    its input runs on the consumer's thread; ``"thread"``: on its own) as where this pass leaves
    it, for the next pass over the same Dataset to start from, as its measurements may decide.

    Raises:
        AssertionError: if that prefetch's depth is not AUTOTUNE (it has no choice to make), or
            ``mode`` is neither.
    """
    try:
        find_stage(iterator, PrefetchIterator).leave_in(mode)
    except ValueError as e:
        raise AssertionError(str(e)) from None

"""Public test helpers: element equality, checkpoint round-trips, identical output, exactly once
under a killed worker; and hooks into a running pass (its stages, knobs, placement, measured
costs, worker processes), so that tests steer what the policy and the autotuner would without
reaching into private state.

Every op's tests use these, so a new op gets its checkpoint and determinism guarantees checked
by adding one line::

    from torchpipe.testing import assert_checkpoint_roundtrip
    assert_checkpoint_roundtrip(tp.range(10).my_op(...))
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import pickle
import random
import signal as signals  # not `signal`: assert_exactly_once has a parameter of that name
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import psutil
import torch
import torch.utils.data._utils.worker as torch_worker

from torchpipe import nest
from torchpipe.autotune import tunable
from torchpipe.autotune.live import walk
from torchpipe.graph.plan import PipelineIterator
from torchpipe.loader import workers as loader_workers
from torchpipe.loader.workers import WorkerIterator
from torchpipe.ops import parallel_map
from torchpipe.ops.interleave.interleave import InterleaveIterator
from torchpipe.ops.prefetch import PrefetchIterator
from torchpipe.randomness import GlobalDraws, watch_global_draws
from torchpipe.runtime.placement import stage as placement_stage
from torchpipe.runtime.placement.policy import CallCosts
from torchpipe.runtime.processes.pool import ProcessPool


def assert_elements_equal(a: Any, b: Any, where: str = "element") -> None:
    """Assert two elements are equal: same structure, same types, dtypes, shapes and values.

    NaNs compare equal to NaNs. Raises AssertionError naming the first difference.
    """
    if nest.is_container(a) or nest.is_container(b):
        if type(a) is not type(b):
            raise AssertionError(f"{where}: {type(a).__name__} vs {type(b).__name__}")
        if isinstance(a, Mapping):
            if list(a.keys()) != list(b.keys()):
                raise AssertionError(f"{where}: keys {list(a.keys())} vs {list(b.keys())}")
            for key in a:
                assert_elements_equal(a[key], b[key], f"{where}[{key!r}]")
            return
        if len(a) != len(b):
            raise AssertionError(f"{where}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            assert_elements_equal(x, y, f"{where}[{i}]")
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        _assert_tensors_equal(a, b, where)
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if type(a) is not type(b) or a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{where}: {_describe(a)} vs {_describe(b)}")
        if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
            raise AssertionError(f"{where}: arrays differ: {a!r} vs {b!r}")
    elif type(a) is not type(b):
        raise AssertionError(f"{where}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}")
    elif a != b and not (a != a and b != b):  # NaN == NaN here
        raise AssertionError(f"{where}: {a!r} != {b!r}")


def _assert_tensors_equal(a: Any, b: Any, where: str) -> None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise AssertionError(f"{where}: {_describe(a)} vs {_describe(b)}")
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{where}: {_describe(a)} vs {_describe(b)}")
    equal_nan = a.is_floating_point() or a.is_complex()
    if not torch.equal(a, b) and not (
        equal_nan and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all())
    ):
        raise AssertionError(f"{where}: tensors differ:\n{a}\nvs\n{b}")


def _describe(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"{type(x).__name__}(dtype={x.dtype}, shape={tuple(x.shape)})"
    return f"{type(x).__name__} {x!r}"


def assert_same_elements(actual: Iterable[Any], expected: Iterable[Any]) -> None:
    """Assert two sequences of elements are equal element by element, and equally long."""
    actual, expected = list(actual), list(expected)
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert_elements_equal(a, b, f"element {i}")
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} elements vs {len(expected)} expected")


def assert_checkpoint_roundtrip(
    dataset: Any,
    *,
    max_elements: int = 200,
    positions: Iterable[int] | None = None,
    ordered: bool = True,
) -> list[Any]:
    """Check that a checkpoint taken after any ``k`` elements resumes exactly.

    One pass takes ``state_dict()`` before every element (pickled, as a user would save it).
    Every state must have the same structure (the same nested keys: a resumed run can load
    into a template taken anywhere). For each position ``k`` a fresh ``iter(dataset)`` loads
    the k-th state; its ``state_dict()`` right then must equal the state, and it must yield
    exactly the elements ``k, k+1, ...`` of that pass, then stop where it stopped. A resume from
    position 0 must reproduce the whole pass, which also checks that ``state_dict()`` has no
    side effects. After the resumed pass at the first, a middle and the last position, the next
    ``iter(dataset)`` must be the epoch after the checkpoint's and, where the pipeline has a
    seed (``Options.seed``), yield what the pass after the reference pass yielded.

    Args:
        dataset: a ``tp.Dataset`` (or anything whose iterators have state_dict/load_state_dict).
        max_elements: look at no more than this many elements (for infinite datasets).
        positions: the positions ``k`` to check (default: all).
        ordered: compare the resumed elements in order; False compares them as a multiset
            (for ``deterministic=False`` pipelines, whose order may differ between runs).

    Returns:
        The elements of the reference pass.
    """
    it = iter(dataset)
    states: list[bytes] = []
    elements: list[Any] = []
    ended = False
    try:
        while len(elements) < max_elements:
            states.append(pickle.dumps(it.state_dict()))
            try:
                elements.append(next(it))
            except StopIteration:
                ended = True
                break
    finally:
        it.close()
    _check_same_structure([pickle.loads(state) for state in states])
    following = _take(iter(dataset), max_elements) if _reproducible(dataset) else None
    chosen = range(len(states)) if positions is None else [k for k in positions if k < len(states)]
    chosen = list(chosen)
    then = {chosen[0], chosen[len(chosen) // 2], chosen[-1]} if chosen else set()
    for k in chosen:
        state = pickle.loads(states[k])
        _check_resume(dataset, state, elements[k:], ended, k, ordered)
        if k in then:
            _check_next_epoch(dataset, state, following, k, ordered)
    return elements


def _check_resume(
    dataset: Any, state: Any, expected: list[Any], ended: bool, k: int, ordered: bool
) -> None:
    resumed = iter(dataset)
    try:
        resumed.load_state_dict(state)
        _assert_states_equal(
            resumed.state_dict(), state, f"resumed at {k}: state_dict() after load_state_dict()"
        )
        got = []
        for i in range(len(expected)):
            try:
                got.append(next(resumed))
            except StopIteration:
                raise AssertionError(
                    f"resumed at {k}: ended after {i} elements, expected {len(expected)}"
                ) from None
        _compare(got, expected, f"resumed at {k}", k, ordered)
        if ended:
            extra = next(resumed, _END)
            if extra is not _END:
                raise AssertionError(f"resumed at {k}: yielded an extra element {extra!r}")
    finally:
        resumed.close()


def _check_next_epoch(
    dataset: Any, state: Any, following: list[Any] | None, k: int, ordered: bool
) -> None:
    """The pass after a resumed one is the epoch after the checkpoint's."""
    after = iter(dataset)
    try:
        if isinstance(state, dict) and "epoch" in state:
            epoch = after.state_dict()["epoch"]
            if epoch != state["epoch"] + 1:
                raise AssertionError(
                    f"resumed at {k}: the next pass is epoch {epoch}, not {state['epoch'] + 1}"
                )
        if following is not None:
            _compare(
                _take(after, len(following)),
                following,
                f"the pass after a resume at {k}",
                0,
                ordered,
            )
    finally:
        after.close()


def _reproducible(dataset: Any) -> bool:
    """Whether two passes of ``dataset`` in the same epoch yield the same elements."""
    options = getattr(dataset, "options", None)
    return callable(options) and options().seed is not None


def _take(iterator: Any, count: int) -> list[Any]:
    try:
        return list(itertools.islice(iterator, count))
    finally:
        iterator.close()


def _compare(got: list[Any], expected: list[Any], where: str, first: int, ordered: bool) -> None:
    if len(got) != len(expected):
        raise AssertionError(f"{where}: {len(got)} elements, expected {len(expected)}")
    if not ordered:
        got, expected = sorted(got, key=repr), sorted(expected, key=repr)
    for i, (g, want) in enumerate(zip(got, expected)):
        assert_elements_equal(g, want, f"{where}, element {first + i}")


def _check_same_structure(states: list[Any]) -> None:
    """Every state has the first one's nested keys."""
    for k, state in enumerate(states[1:], 1):
        difference = _structure_difference(states[0], state, "state")
        if difference is not None:
            raise AssertionError(
                f"the state's structure changed between positions 0 and {k}: {difference}"
            )


def _structure_difference(a: Any, b: Any, where: str) -> str | None:
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        kinds = ["a dict" if isinstance(x, Mapping) else type(x).__name__ for x in (a, b)]
        return f"{where} is {kinds[0]}, then {kinds[1]}"
    if not isinstance(a, Mapping):
        return None
    if set(a) != set(b):
        return f"{where} has keys {sorted(a, key=str)}, then {sorted(b, key=str)}"
    for key in a:
        difference = _structure_difference(a[key], b[key], f"{where}[{key!r}]")
        if difference is not None:
            return difference
    return None


def _assert_states_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            raise AssertionError(f"{where}: keys {sorted(a, key=str)} vs {sorted(b, key=str)}")
        for key in a:
            _assert_states_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            raise AssertionError(f"{where}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_states_equal(x, y, f"{where}[{i}]")
    else:
        assert_elements_equal(a, b, where)


_END = object()
SIGNAL_WAIT_S = 10.0
"""How long :func:`assert_exactly_once` waits for the worker it signalled to end."""


def assert_exactly_once(
    make: Callable[[], Iterable[Any]],
    seed: int = 0,
    ordered: bool = True,
    kill: Callable[[random.Random], Any] | None = None,
    signal: int = signals.SIGKILL,
    expected: Iterable[Any] | None = None,
) -> Any:
    """Assert that ``make()`` yields every element once, in order, when one of its worker
    processes is killed (SIGKILL, or ``signal``) at a random point.

    ``make()`` builds the iterable afresh (a ``tp.Dataset`` or a DataLoader). The elements
    expected are ``expected`` where given (an independent expectation: a bug that loses an
    element in every run is caught too), else those of an undisturbed run. In a second run, at
    an element drawn from ``seed`` between a quarter and three quarters of the way, one worker
    process that this run started is killed: a process of this process tree with none of its own
    (a worker, not a zygote). Where none runs (inline, threads) nothing is killed and the run must
    still match. With ``ordered=False`` the order may differ, but not the elements or how often
    each comes.

    Args:
        make: builds the iterable to run.
        seed: draws the element at which to kill, and the worker.
        ordered: compare in order; False compares multisets.
        kill: kills something else instead, given a ``random.Random`` seeded from ``seed``, and
            returns what it killed (None: nothing): for a stage on Ray actors,
            ``torchpipe.runtime.ray.pool.kill_an_actor``.
        signal: the signal sent to the worker (``signal.SIGTERM``: an operator's ``kill``, a
            cgroup shrink). The worker must end of it: one still running after
            ``SIGNAL_WAIT_S`` fails the assertion, since it was not treated as a dead worker.
        expected: the elements ``make()`` must yield; default: what an undisturbed run yields.

    Returns:
        The pid killed (what ``kill`` returned), or None where no worker process ran.

    Raises:
        AssertionError: naming the elements lost, repeated or out of place, or for a worker
            that outlived ``signal``.
    """
    expected = list(make()) if expected is None else list(expected)
    rng = random.Random(seed)
    at = rng.randint(len(expected) // 4, max(len(expected) // 4, 3 * len(expected) // 4))
    before = {
        p.pid for p in psutil.Process().children(recursive=True)
    }  # other runs' processes stay
    actual, killed = [], None
    for k, element in enumerate(make()):
        actual.append(element)
        if k == at:
            killed = _kill_a_worker(rng, before, signal) if kill is None else kill(rng)
    where = f"a worker killed at element {at}"
    try:
        _compare(actual, expected, where, 0, ordered)
    except AssertionError as e:
        raise AssertionError(f"{e}; {_difference(actual, expected)}") from None
    return killed


def _difference(actual: list[Any], expected: list[Any]) -> str:
    """Name the elements ``actual`` lost and those it has more often than ``expected``.

    Elements are told apart by ``repr`` (tensors, arrays and dicts are not hashable).
    """
    have, want = collections.Counter(map(repr, actual)), collections.Counter(map(repr, expected))
    lost, extra = sorted((want - have).elements()), sorted((have - want).elements())
    return f"lost: [{', '.join(lost)}]; repeated or unexpected: [{', '.join(extra)}]"


def _kill_a_worker(rng: random.Random, spared: set[int], signum: int) -> int | None:
    workers = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid not in spared and not process.children():
                workers.append(process.pid)
        except psutil.NoSuchProcess:
            continue
    if not workers:
        return None
    pid = rng.choice(sorted(workers))
    os.kill(pid, signum)
    if not _ends(pid, SIGNAL_WAIT_S):
        name = signals.Signals(signum).name
        raise AssertionError(f"worker process {pid} still runs {SIGNAL_WAIT_S} s after {name}")
    return pid


def _ends(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` is gone, or a zombie (dead, not yet reaped), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


# -- hooks into a running pass ------------------------------------------------------------------
# White-box tests steer a pass as the policy or the autotuner would; these are the one place that
# knows where a pass keeps its stages, placements, knobs and pools.


def stages(iterator: Any) -> list[Any]:
    """The stages of a running pass, root first, depth first: the op iterators of ``iter(ds)``
    once it yielded an element (or loaded a state), or the workers' stage of a DataLoader's
    iterator.

    Raises:
        AssertionError: if the pass has not started (nothing built yet).
    """

    if isinstance(iterator, WorkerIterator):
        return [iterator._stage]
    root = iterator._tree if isinstance(iterator, PipelineIterator) else iterator
    if root is None:
        raise AssertionError("the pass has not started: take an element first")
    return [stage for stage, _ in walk(root)]


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

    owners = [iterator] if isinstance(iterator, WorkerIterator) else stages(iterator)
    for owner in owners:
        placement = getattr(owner, "_placement", None)
        if placement is not None and placement.policy is not None:
            placement.move(kind, workers)
            return
    raise AssertionError(
        "no stage of this pass is placed by a policy (executor='auto', num_workers='auto')"
    )


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

    def measure(
        run: Callable[[int], list[Any]],
        limit: int = 8,
        on_draws: Callable[[GlobalDraws], None] | None = None,
    ) -> tuple[CallCosts, int]:
        with watch_global_draws() as draws:
            done = run(limit)
        if on_draws is not None:
            on_draws(draws)
        return costs, len(done)

    def replica_costs(pool: Any) -> tuple[int, float, float, int]:
        calls = pool.timing.totals()[0]
        waiting = 1.0 - costs.cpu_s / costs.call_s if costs.call_s > 0 else 0.0
        return (
            calls,
            costs.call_s * calls,
            costs.cpu_s * calls,
            round(4 * calls * waiting),
        )  # asleep as it waits

    patches: list[tuple[Any, str, Any]] = [
        (parallel_map, "measure_calls", measure),
        (loader_workers, "measure_calls", measure),
        (loader_workers, "replica_costs", replica_costs),
    ]
    # no verdict is ever agreed on: nothing moves on a prediction, so nothing is tried
    if not moves:
        patches.append(
            (
                placement_stage,
                "CALLS",
                dataclasses.replace(placement_stage.CALLS, agree=sys.maxsize),
            )
        )
    saved = [getattr(module, name) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)  # the names these modules call
    try:
        yield
    finally:
        for (module, name, _), original in zip(patches, saved):
            setattr(module, name, original)


def zygote_pids(iterator: Any) -> list[int]:
    """The pids of the zygotes (the processes worker processes are forked from) that the process
    pools of a running pass or DataLoader iterator hold now."""
    return [
        pid
        for pool in _process_pools(iterator)
        for pid in sorted(set(pool.process_ids) - set(worker_pids(pool)))
    ]


def worker_pids(pool: Any) -> list[int]:
    """The pids of every worker process a ``ProcessPool`` holds, retiring ones too."""
    return [worker.pid for worker in pool._workers.values()]


def worker_rings(pool: Any) -> list[list[Any]]:
    """The shared-memory rings (``ShmRing``) of each worker of a ``ProcessPool``, as mapped in
    this process, in the order the worker added them."""
    return [
        [loans.ring for loans in worker.rings if loans is not None]
        for worker in pool._workers.values()
    ]


def ring_slots(iterator: Any) -> list[int]:
    """The slots of each worker's newest ring in the process pools a running pass or DataLoader
    iterator holds: the results the worker may have in flight and held at once."""
    return [
        rings[-1].slots
        for pool in _process_pools(iterator)
        for rings in worker_rings(pool)
        if rings
    ]


def _process_pools(iterator: Any) -> list[Any]:

    owners = [iterator] if isinstance(iterator, WorkerIterator) else stages(iterator)
    pools = [getattr(owner, "_pool", None) for owner in owners]
    return [pool for pool in pools if isinstance(pool, ProcessPool)]


def node(dataset: Any) -> Any:
    """The logical node (``torchpipe.core.node.Node``) at the root of ``dataset``, as written."""
    return dataset._node


def running_node(dataset: Any) -> Any:
    """The root node of ``dataset`` as it will run: after the shard rewrites and the optimizer's
    passes (what ``explain()`` prints under "As it will run")."""
    return dataset._plan().runtime_root


def open_readers(iterator: Any) -> list[Any]:
    """The open readers of the first interleave stage of a running pass: those in the cycle's
    slots, then those opened ahead of them, in input order."""
    stage = find_stage(iterator, InterleaveIterator)
    return [*(reader for reader in stage._slots if reader is not None), *stage._ahead]


def release_readers(iterator: Any, readers: list[Any]) -> list[Any]:
    """Release ``readers`` (see :func:`open_readers`) from their pool, as a move to another
    executor does first; their places (``ReaderPlace``), with what each had read ahead."""
    return list(find_stage(iterator, InterleaveIterator)._pool.release(readers))


def reader_capacity(iterator: Any) -> int:
    """The items one reader of the first interleave stage of a running pass may hold ready or
    in flight now (its read-ahead)."""
    return int(find_stage(iterator, InterleaveIterator)._pool.reader_capacity())


def start_as_measured(loader: Any, processes: int | None, replicas: int | None = None) -> None:
    """Have a ``DataLoader(num_workers="auto")`` start its next epoch where an earlier epoch's
    measurements left it: on ``processes`` worker processes (None: measure afresh) and, over an
    IterableDataset, with ``replicas`` replicas (None: as many as it would start with).

    Raises:
        AssertionError: if ``loader`` is not a ``tp.DataLoader`` with ``num_workers="auto"``.
    """
    state = loader.__dict__.get("_tp")
    if state is None or not state.workers_auto:
        raise AssertionError("start_as_measured() takes a tp.DataLoader with num_workers='auto'")
    state.tuned_workers, state.replicas = processes, replicas


def leave_prefetch_in(iterator: Any, mode: str) -> None:
    """Have the first ``prefetch(tp.AUTOTUNE)`` of a running pass take ``mode`` (``"inline"``:
    its input runs on the consumer's thread; ``"thread"``: on its own) as where this pass leaves
    it, for the next pass over the same Dataset to start from, as its measurements may decide.

    Raises:
        AssertionError: if that prefetch's depth is not AUTOTUNE (it has no choice to make).
    """
    stage = find_stage(iterator, PrefetchIterator)
    if stage._choice is None:
        raise AssertionError(
            "the prefetch is not prefetch(tp.AUTOTUNE): it always runs its input on its thread"
        )
    stage._choice.mode = mode


@contextlib.contextmanager
def as_in_a_fresh_process() -> Iterator[None]:
    """Within the block, what a process measures or says once is not known yet, as in a new
    process: the GIL probe's calibration, the message cost its pools observed, the warning that
    tqdm is missing. Each is put back after the block, so later tests see this process's own."""
    from torchpipe.observe import progress
    from torchpipe.runtime.placement import gil, policy

    saved = (gil.GilProbe._calibrated, policy._observed_message_s, progress._warned)
    gil.GilProbe._calibrated, policy._observed_message_s, progress._warned = None, None, False
    try:
        yield
    finally:
        gil.GilProbe._calibrated, policy._observed_message_s, progress._warned = saved


@contextlib.contextmanager
def as_torch_worker(index: int, num_workers: int, seed: int = 1000) -> Iterator[None]:
    """Within the block, this process is torch's DataLoader worker ``index`` of ``num_workers``
    as ``torch.utils.data.get_worker_info()`` (and torchpipe's sharding) sees it, with seed
    ``seed + index``: a pipeline's split between workers is checked without forking any."""
    before = torch_worker._worker_info
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=index,
        num_workers=num_workers,
        seed=seed + index,
        dataset=None,  # type: ignore[arg-type]  # none here
    )
    try:
        yield
    finally:
        torch_worker._worker_info = before

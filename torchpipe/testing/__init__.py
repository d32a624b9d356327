"""Public test helpers: element equality, checkpoint round-trips, identical output, exactly once
under a killed worker, a pipeline as torch's worker or a fresh process sees it; and, handed on
from :mod:`torchpipe.testing.hooks`, hooks into a running pass (its stages, knobs, placement,
measured costs, worker processes), so that tests steer what the policy and the autotuner would
without reaching into private state.

Every op's tests use these, so a new op gets its checkpoint and determinism guarantees checked
by adding one line::

    from torchpipe.testing import assert_checkpoint_roundtrip
    assert_checkpoint_roundtrip(tp.range(10).my_op(...))
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import pickle
import random
import signal as signals  # not `signal`: assert_exactly_once has a parameter of that name
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import psutil
import torch
import torch.utils.data._utils.worker as torch_worker

from torchpipe import nest
from torchpipe.observe.progress import missing_tqdm_unwarned
from torchpipe.runtime.placement.costs import message_cost_unobserved
from torchpipe.runtime.placement.gil import GilProbe
from torchpipe.testing.hooks import (
    find_stage,
    forced_call_costs,
    keep_calls,
    knobs,
    leave_prefetch_in,
    move_calls,
    node,
    open_readers,
    reader_capacity,
    release_readers,
    ring_slots,
    running_node,
    stages,
    start_as_measured,
    worker_pids,
    worker_rings,
    zygote_pids,
)

__all__ = [
    "SIGNAL_WAIT_S",
    "as_in_a_fresh_process",
    "as_torch_worker",
    "assert_checkpoint_roundtrip",
    "assert_elements_equal",
    "assert_exactly_once",
    "assert_same_elements",
    "find_stage",
    "forced_call_costs",
    "knobs",
    "leave_prefetch_in",
    "keep_calls",
    "move_calls",
    "node",
    "open_readers",
    "reader_capacity",
    "release_readers",
    "ring_slots",
    "running_node",
    "stages",
    "start_as_measured",
    "worker_pids",
    "worker_rings",
    "zygote_pids",
]


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
    reference = _ReferencePass(dataset, max_elements)
    following = _take(iter(dataset), max_elements) if _reproducible(dataset) else None
    for k, and_the_next_pass in reference.positions(positions):
        state = reference.state(k)
        _check_resume(dataset, state, reference.elements[k:], reference.ended, k, ordered)
        if and_the_next_pass:
            _check_next_epoch(dataset, state, following, k, ordered)
    return reference.elements


class _ReferencePass:
    """The pass :func:`assert_checkpoint_roundtrip` resumes: its first ``max_elements`` elements,
    the state before each (pickled, as a user would save it), and whether it ended there.

    Raises:
        AssertionError: if a state's structure differs from the first one's.
    """

    def __init__(self, dataset: Any, max_elements: int) -> None:
        self.states: list[bytes] = []
        self.elements: list[Any] = []
        self.ended = False
        it = iter(dataset)
        try:
            while len(self.elements) < max_elements:
                self.states.append(pickle.dumps(it.state_dict()))
                try:
                    self.elements.append(next(it))
                except StopIteration:
                    self.ended = True
                    break
        finally:
            it.close()
        _check_same_structure([pickle.loads(state) for state in self.states])

    def state(self, k: int) -> Any:
        """The state taken before element ``k``, unpickled afresh."""
        return pickle.loads(self.states[k])

    def positions(self, chosen: Iterable[int] | None) -> list[tuple[int, bool]]:
        """The positions to resume at (``chosen`` that the pass reached, default: all), each with
        whether the pass after the resume is checked too: at the first, a middle and the last."""
        count = len(self.states)
        ks = list(range(count)) if chosen is None else [k for k in chosen if k < count]
        then = {ks[0], ks[len(ks) // 2], ks[-1]} if ks else set()
        return [(k, k in then) for k in ks]


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
"""How long :func:`assert_exactly_once` waits for the worker it signalled to end: one still
running then fails the assertion, since it was not treated as a dead worker."""


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

    A second run, at an element drawn from ``seed`` between a quarter and three quarters of the
    way, kills a worker process it started (of this process tree, with none of its own: not a
    zygote); where none runs (inline, threads) it kills none and must still match.

    Args:
        make: builds the iterable to run afresh (a ``tp.Dataset`` or a DataLoader).
        seed: draws the element at which to kill, and the worker.
        ordered: compare in order; False compares multisets (how often each comes still counts).
        kill: kills something else instead (for a stage on Ray actors,
            ``torchpipe.runtime.ray.pool.kill_an_actor``): given a ``random.Random`` seeded from
            ``seed``, it returns what it killed (None: nothing).
        signal: the signal sent to the worker (``signal.SIGTERM``: an operator's ``kill``, a
            cgroup shrink), which must end it within :data:`SIGNAL_WAIT_S`.
        expected: the elements ``make()`` must yield, an independent expectation (a bug that
            loses an element in every run is caught too); default: what an undisturbed run yields.

    Returns:
        The pid killed (what ``kill`` returned), or None where no worker process ran.

    Raises:
        AssertionError: naming elements lost, repeated or out of place, or a signalled worker alive.
    """
    expected = list(make()) if expected is None else list(expected)
    rng, at = _draw_the_element(seed, len(expected))
    kill_one = _a_worker_killer(rng, signal) if kill is None else functools.partial(kill, rng)
    actual, killed = _run_killing_at(make, at, kill_one)
    _assert_once_each(actual, expected, f"a worker killed at element {at}", ordered)
    return killed


def _draw_the_element(seed: int, count: int) -> tuple[random.Random, int]:
    """The generator seeded from ``seed``, and the element it drew of ``count``, between a
    quarter and three quarters of the way, at which to kill."""
    rng = random.Random(seed)
    return rng, rng.randint(count // 4, max(count // 4, 3 * count // 4))


def _a_worker_killer(rng: random.Random, signum: int) -> Callable[[], int | None]:
    """Kills, with ``signum``, a worker process started from now on: the processes of this tree
    now (other runs') are spared. See :func:`_kill_a_worker`."""
    spared = {p.pid for p in psutil.Process().children(recursive=True)}
    return functools.partial(_kill_a_worker, rng, spared, signum)


def _run_killing_at(
    make: Callable[[], Iterable[Any]], at: int, kill: Callable[[], Any]
) -> tuple[list[Any], Any]:
    """The elements of ``make()``, with ``kill()`` called once element ``at`` came; and what
    ``kill()`` returned (None where the run ended before)."""
    actual, killed = [], None
    for k, element in enumerate(make()):
        actual.append(element)
        if k == at:
            killed = kill()
    return actual, killed


def _assert_once_each(actual: list[Any], expected: list[Any], where: str, ordered: bool) -> None:
    """Assert that ``actual`` is ``expected`` (as multisets, unless ``ordered``), naming the
    elements lost and repeated where it is not."""
    try:
        _compare(actual, expected, where, 0, ordered)
    except AssertionError as e:
        raise AssertionError(f"{e}; {_difference(actual, expected)}") from None


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


@contextlib.contextmanager
def as_in_a_fresh_process() -> Iterator[None]:
    """Within the block, what a process measures or says once is not known yet, as in a new
    process: the GIL probe's calibration, the message cost its pools observed, the warning that
    tqdm is missing. Each is put back after the block, so later tests see this process's own."""
    with GilProbe.uncalibrated(), message_cost_unobserved(), missing_tqdm_unwarned():
        yield


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

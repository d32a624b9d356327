"""What a stage's calls cost, and what each executor is predicted to deliver from those costs.

:class:`CallCosts` holds what was measured of one call (wall and CPU time, the share of it the GIL
is free, what receiving its result from a worker costs, the consumer's own time);
:func:`predict` turns them into seconds per element inline, on threads and on processes, and
:func:`workers` into how many threads or processes to start with. The rule that chooses between
executors from these predictions and from what was measured is
:mod:`torchpipe.runtime.placement.policy`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

from torchpipe.runtime.placement.memory_costs import CACHED_BYTES, byte_seconds

INLINE, THREAD, PROCESS = "inline", "thread", "process"
KINDS = (INLINE, THREAD, PROCESS)
RAY = "ray"
"""Ray actors (``runtime/ray/pool.py``): only where a stage asks for them, never the policy's pick."""

HANDOFF_S = 10e-6
"""This process's cost of one call on a thread: queueing it and taking its result (measured
8-12 us with the GIL contended)."""
MESSAGE_S = 100e-6
"""This process's cost of one result from a worker besides decoding it (the socket messages, the
wake-ups, the bookkeeping) until a pool has measured it (:func:`observe_message_cost`): measured
100-150 us of CPU on the 2-core CI machine, where the syscalls of a wake-up dominate."""
_observed_message_s: float | None = None
MAX_THREADS = 64
"""The most threads a stage runs (calls that wait on I/O want many)."""
THREAD_FREE_SHARE = 0.6
"""The GIL-free share of a call from which threads start to overlap it (fully at 1). Traced on 2
cores, JPEG decodes and TFRecord parses seen 0.59-0.75 free ran 1.3-1.5x slower on 2 threads
than on 2 processes (``tfrecord``: 57-70 ms a batch against 38-47): from 0.5, 0.74 was predicted
as fast as processes, and the first placement went to threads, to be left after a trial."""
WAITS_FOR_MORE = 1.5
"""Calls whose wall time is this many times their CPU time get more threads or processes than cores."""


@dataclasses.dataclass(frozen=True)
class CallCosts:
    """What one call costs, measured.

    Attributes:
        call_s: wall seconds of one call, run alone on this process's thread.
        cpu_s: CPU seconds of it (``call_s`` less its waits on I/O).
        gil_free: the share of the call during which the GIL was free (0 to 1): C code that
            releases it (decoding, numpy, torch, I/O) against Python.
        move_s: seconds this process spends receiving one result from a worker process
            (decoding it, besides :data:`MESSAGE_S`); a worker spends about as much encoding it.
            Measured on a record in this process's cache, so at least what copying ``nbytes``
            costs at the machine's memory bandwidth is counted on each side.
        consumer_s: the consumer's own seconds per element, between two of its requests.
        thread_safe: whether calls may run on threads at all (reproducibility: a call that
            draws from the global RNGs, in a stage that must reproduce them, may not).
        handoff_s: this process's cost of one call on a thread (:data:`HANDOFF_S` unless measured).
        message_s: this process's cost of one result from a worker besides decoding it; None: what
            pools in this process measured (:func:`message_cost`). Less where results travel many
            to a message.
        threads_in_workers: worker processes run several calls at once on threads of their own
            (an interleave's readers), so calls that wait overlap there as on threads.
        most: the calls the stage runs at once, where the user fixed it (None: as many as pay).
        nbytes: the bytes of one result a move between processes copies on each side (its
            blobs and pickled data; tensor and array data is written once and viewed).
    """

    call_s: float
    cpu_s: float
    gil_free: float
    move_s: float
    consumer_s: float = 0.0
    thread_safe: bool = True
    handoff_s: float = HANDOFF_S
    message_s: float | None = None
    threads_in_workers: bool = False
    most: int | None = None
    nbytes: int = 0

    def without_threads(self) -> CallCosts:
        """These costs, for calls that must not run on threads."""
        return dataclasses.replace(self, thread_safe=False)


def observe_message_cost(seconds: float) -> None:
    """What a process pool measured one result to cost this process (its CPU per result)."""
    global _observed_message_s
    previous = _observed_message_s
    _observed_message_s = seconds if previous is None else 0.5 * (previous + seconds)


@contextlib.contextmanager
def message_cost_unobserved() -> Iterator[None]:
    """A seam for tests: within the block no pool has observed a result's cost yet, as in a new
    process (:func:`message_cost` is :data:`MESSAGE_S`); the observed one is put back after."""
    global _observed_message_s
    before, _observed_message_s = _observed_message_s, None
    try:
        yield
    finally:
        _observed_message_s = before


def message_cost() -> float:
    """This process's cost of one result from a worker: as pools here measured it, else :data:`MESSAGE_S`."""
    return _observed_message_s if _observed_message_s is not None else MESSAGE_S


def workers(costs: CallCosts, kind: str, cores: int) -> int:
    """How many threads or processes to start with: one a core, more for calls that mostly wait
    (wall time 1.5x their CPU time or more: a little waiting is page faults and contention, and
    a process too many holds its share of results in memory for nothing)."""
    if kind == INLINE:
        return 0
    waits = _wall_per_cpu(costs)
    wanted = math.ceil(cores * waits) if waits >= WAITS_FOR_MORE else cores
    if costs.most is not None:
        wanted = min(wanted, costs.most)
    if kind == THREAD or costs.threads_in_workers:
        return max(1, min(MAX_THREADS, wanted))
    return max(1, min(2 * cores, wanted))


def most_processes(costs: CallCosts | None, cores: int) -> int:
    """The most worker processes the autotuner may give calls that cost ``costs``: one a core for
    calls that compute (wall time under :data:`WAITS_FOR_MORE` times their CPU time), twice the
    cores for calls that wait or whose costs are not known yet. A process past the cores cannot
    make computing calls faster, only hold a worker's memory more (``bigtensor``'s DSL: tuned to 4
    processes on 2 cores in some runs, 410-520 MB against torch's 2 workers' 390)."""
    return 2 * cores if costs is None or _wall_per_cpu(costs) >= WAITS_FOR_MORE else cores


def _wall_per_cpu(costs: CallCosts) -> float:
    """A call's wall seconds per CPU second (at most 20: a call that only waits)."""
    return costs.call_s / max(costs.cpu_s, costs.call_s * 0.05, 1e-9)


def predict(costs: CallCosts, kind: str, cores: int) -> float:
    """Seconds per element the consumer gets from ``kind`` at steady state.

    Inline, a call and the consumer take turns. On threads, calls overlap but their GIL-held part
    (and the hand-off) does not, nor the consumer's Python; all CPU shares ``cores``. On
    processes, this process receives every result, and the workers encode them: each side
    copies the result's bytes at least at the machine's memory bandwidth (:func:`transfer_seconds`).
    """
    c = costs
    if kind == INLINE:
        return c.call_s + c.consumer_s
    n = workers(c, kind, cores)
    if kind == THREAD:
        # Short GIL releases (a call made of many small C operations) do not let another thread
        # run: it waits its turn for a switch interval. Only the free share above
        # THREAD_FREE_SHARE counts, ramping to all of it at 1 (calls waiting on I/O, ~1.0:
        # threads overlap them fully).
        free = max(0.0, (c.gil_free - THREAD_FREE_SHARE) / (1.0 - THREAD_FREE_SHARE))
        held = min((1.0 - free) * c.call_s, c.cpu_s)  # a call waiting on I/O does not hold it
        serial = held + c.handoff_s + c.consumer_s
        cpu = c.cpu_s + c.handoff_s + c.consumer_s
        return max(c.call_s / n, serial, cpu / cores)
    move = transfer_seconds(c)
    receive = (c.message_s if c.message_s is not None else message_cost()) + move
    cpu = c.cpu_s + move + receive + c.consumer_s  # the worker encodes what this process decodes
    return max((c.call_s + move) / n, receive + c.consumer_s, cpu / cores)


def transfer_seconds(costs: CallCosts) -> float:
    """Seconds each side spends moving one result between processes: decoding it as measured,
    and, for a result larger than a core's cache, at least a copy of its bytes at the machine's
    memory bandwidth (another core wrote them)."""
    if costs.nbytes < CACHED_BYTES:
        return costs.move_s
    return max(costs.move_s, costs.nbytes * byte_seconds())


def cost_scale(before: CallCosts, now: CallCosts) -> float | None:
    """How many times dearer the calls got, where their work is of the same kind: the share of a
    call spent on the CPU moved by less than 2x (a machine that got busier, larger inputs); None
    where it did not (calls that now wait on I/O where they computed, or the reverse)."""
    if before.call_s <= 0 or now.call_s <= 0:
        return None
    shares = sorted((max(before.cpu_s / before.call_s, 1e-3), max(now.cpu_s / now.call_s, 1e-3)))
    return now.call_s / before.call_s if shares[1] <= 2.0 * shares[0] else None

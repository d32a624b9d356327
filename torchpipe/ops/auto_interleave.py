"""``interleave(..., num_parallel_calls=N, executor="auto")``: readers start on threads and move to
worker processes, mid-pass, when they turn out to do real work.

Threads cost nothing to start and nothing per element, which suits readers that only wait (on
files, on remote storage) or hand over ready-made tensors. Readers that also parse records in
Python hold the GIL for it, and on threads that work shares one core with the training loop. So
the pass starts on threads and measures what each element costs its reader (wall and CPU time)
and this thread; the runtime's executor policy (``torchpipe.runtime.policy``, the rule map and the
DataLoader use too) then says whether worker processes would deliver faster, by
``ONE_WAY_MARGIN`` since the move is not undone, and if so the running interleave is handed over
to worker processes that run their reads on threads of their own (one process per core; see
:class:`ProcessInterleaveIterator`). The handover keeps the input
position, the interleave's cycle and every open reader's place, so no element is lost, repeated
or reordered; what the threads had read ahead moves over too, so nothing is read twice.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from torchpipe.ops.base import Iterator
from torchpipe.ops.interleave_base import Handover
from torchpipe.ops.process_interleave import ProcessInterleaveIterator
from torchpipe.ops.stats import LiveKnob
from torchpipe.ops.thread_interleave import ThreadInterleaveIterator
from torchpipe.runtime import codec
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.policy import ONE_WAY_MARGIN, PROCESS, THREAD, CallCosts, choose
from torchpipe.runtime.timing import CallTiming

_DECIDE_READS = 32  # elements read before choosing (after the first _CHECK_EVERY delivered, whose
_DECIDE_S = 0.05  # reads carry one-time costs), and seconds since then
_CHECK_EVERY = 16  # elements delivered between looks at the counters
_BUSIEST = 0.95  # the GIL share readers are taken to use at most (a queue at 1 waits forever)
RECEIVE_S = 5e-6
"""What receiving an element read by a worker costs this process (elements travel in chunks of
many, as columns where they can): measured about 5 us."""


class AutoInterleaveIterator(Iterator):
    """A parallel interleave on threads that hands itself over to worker processes if its readers
    do real work (see the module docstring).

    Both iterators are built up front over the same input, so the process one can fork its
    zygote in :meth:`prepare`, before the pipeline starts threads; the one not used is shut down.
    They share this iterator's stats, and the parallelism knob moves with the handover, so the
    autotuner goes on turning it.

    Args:
        name: the stage name.
        source: the input iterator (both iterators' input).
        threads: the iterator the pass starts on.
        processes: the iterator it may move to (``threads_in_workers``), or None where worker
            processes are not supported.
    """

    tuning_role = "pool"

    def __init__(self, name: str, source: Iterator, threads: ThreadInterleaveIterator,
                 processes: ProcessInterleaveIterator | None) -> None:  # fmt: skip
        super().__init__(name, source)
        self.stats.calls = CallTiming()
        for iterator in (threads, processes):
            if iterator is not None:
                iterator.stats = self.stats  # one set of counters, whichever runs
        self._threads: ThreadInterleaveIterator | None = threads
        self._processes = processes
        self._current: ThreadInterleaveIterator | ProcessInterleaveIterator = threads
        self._deciding = processes is not None
        self._since: tuple[float, tuple[int, float, float]] | None = None  # when, and the totals then

    @property
    def executor_kind(self) -> str:
        """``thread`` or ``process`` once chosen; ``auto`` while it is being measured."""
        if self._deciding:
            return "auto"
        return "process" if self._current is self._processes else "thread"

    def prepare(self) -> None:
        if self._processes is not None:
            self._processes.prepare()  # forks the zygote, and prepares the input
        else:
            super().prepare()

    def start(self) -> None:
        self._threads.start()

    def next(self) -> Any:
        try:
            element = self._current.next()
        except StopIteration:
            if self._deciding:
                self._settle()
            raise
        if self._deciding and (self.stats.produced + 1) % _CHECK_EVERY == 0:  # this one not counted yet
            self._maybe_decide(element)
        return element

    def _maybe_decide(self, element: Any) -> None:
        """Measure the reads from the first look on; choose once there are enough of them."""
        now, totals = time.perf_counter(), self.stats.calls.totals()
        if self._since is None:
            self._since = now, totals
            return
        then, (reads0, wall0, cpu0) = self._since
        reads, wall_s, cpu_s = totals[0] - reads0, totals[1] - wall0, totals[2] - cpu0
        if reads < _DECIDE_READS or now - then < _DECIDE_S:
            return
        if self._processes_faster(reads, wall_s, cpu_s, now - then):
            if _travels(self._threads.hand_over(), element):
                self._threads.stop_reading()  # what they read moves over with them
                self._to_processes(self._threads.hand_over(read_ahead=True), wall_s / cpu_s)
        self._settle()

    def _processes_faster(self, reads: int, wall_s: float, cpu_s: float, seconds: float) -> bool:
        """Whether the policy moves readers whose ``reads`` over the last ``seconds`` cost ``wall_s``
        and ``cpu_s`` in all to processes.

        A read's CPU time is taken to hold the GIL (parsing in Python). Its wall time on threads
        also holds its waits for the GIL while the other readers run: with the readers keeping the
        GIL busy a share ``u`` of the time, a read waits about ``cpu u / (1 - u)`` for it, which a
        read alone (in a worker) would not. This thread's own time per element is the threads'
        hand-off, and no less on processes."""
        stats = self.stats
        handoff = max(stats.wall_s - stats.wait_s, 0.0) / max(stats.produced, 1)
        cpu, busy = cpu_s / reads, min(cpu_s / seconds, _BUSIEST) if seconds > 0 else _BUSIEST
        alone = max(cpu, wall_s / reads - cpu * busy / (1.0 - busy))
        costs = CallCosts(alone, cpu, 1.0 - cpu / alone if alone > 0 else 1.0, 0.0, handoff_s=handoff,
                          message_s=max(RECEIVE_S, handoff), threads_in_workers=True,
                          most=None if self.knobs() else self.parallelism())  # fmt: skip
        return choose(costs, usable_cpu_count(), (THREAD, PROCESS), current=THREAD, margin=ONE_WAY_MARGIN) == PROCESS

    def _settle(self) -> None:
        """The choice is made: shut down the iterator not chosen."""
        self._deciding = False
        if self._current is not self._processes and self._processes is not None:
            self._processes.shutdown()
            self._processes = None

    def _to_processes(self, handover: Handover, wall_per_cpu: float) -> None:
        """Hand the pass over; with AUTOTUNE, start at the reads in flight that would keep every
        core busy if reading were all there was (the autotuner takes it from there)."""
        self._threads.shutdown()
        self._threads = None
        processes = self._processes
        processes.start()
        if handover.knob is not None:  # take_over applies it before the first task is sent
            handover.knob.request(round(usable_cpu_count() * max(wall_per_cpu, 1.0)))
        processes.take_over(handover)
        self._current = processes

    def get_state(self) -> dict[str, Any]:
        return self._current.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._current.set_state(state)  # the threads: a pass always starts there

    def knobs(self) -> list[LiveKnob]:
        return self._current.knobs()

    def parallelism(self) -> int:
        return self._current.parallelism()

    def buffer_slots(self) -> int:
        return self._current.buffer_slots()

    def calls_in_processes(self) -> bool:
        return self._current.calls_in_processes()

    def shutdown(self) -> None:
        for iterator in (self._threads, self._processes):
            if iterator is not None:
                iterator.shutdown()


def _travels(handover: Handover, element: Any) -> bool:
    """Whether the open readers' input elements and positions can be sent to a worker, and what
    they read can come back (``element``, the one just delivered, stands for it). Where not (an
    open file object, a lock), the pipeline stays on threads."""
    readers = [entry for entry in [*handover.slots, *handover.ahead] if entry is not None]
    try:
        pickle.dumps([(entry.element, entry.inner) for entry in readers], pickle.HIGHEST_PROTOCOL)
        codec.encode(element)  # tensors are not copied: only the rest is pickled
    except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
        return False
    return True

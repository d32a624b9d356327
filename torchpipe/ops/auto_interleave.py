"""``interleave(..., num_parallel_calls=N, executor="auto")``: readers start on threads and move to
worker processes, mid-pass, when they turn out to do real work.

Threads cost nothing to start and nothing per element, which suits readers that only wait (on
files, on remote storage) or hand over ready-made tensors. Readers that also parse records in
Python hold the GIL for it, and on threads that work shares one core with the training loop. So
the pass starts on threads, measures the CPU each element costs its reader, and where that is at
least ``_PROCESS_MIN_READ_CPU_S`` (several times what an element costs to receive from a worker),
hands the running interleave over to worker processes that run their reads on threads of their
own (one process per core; see :class:`ProcessInterleaveIterator`). The handover keeps the input
position, the interleave's cycle and every open reader's place, so no element is lost, repeated
or reordered: what threads had read ahead is read again by the processes.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from torchpipe.ops.base import Iterator
from torchpipe.ops.process_interleave import ProcessInterleaveIterator
from torchpipe.ops.stats import LiveKnob
from torchpipe.ops.thread_interleave import ThreadInterleaveIterator
from torchpipe.runtime import codec
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.timing import CallTiming

_DECIDE_READS = 32  # elements read before choosing,
_DECIDE_S = 0.05  # and seconds since the first element
_CHECK_EVERY = 16  # elements delivered between looks at the counters
_SAMPLED_ITEMS = 4  # items read that must travel back from a worker before readers move there
_PROCESS_MIN_READ_CPU_S = 15e-6
"""CPU seconds per element read from which readers move to processes: receiving an element from
a worker costs the main process about 5 us, so below this threads are cheaper."""


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
        self._delivered = 0
        self._first_at: float | None = None

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
        if self._deciding:
            self._delivered += 1
            if self._first_at is None:
                self._first_at = time.perf_counter()
            elif self._delivered % _CHECK_EVERY == 0:
                self._maybe_decide()
        return element

    def _maybe_decide(self) -> None:
        reads, wall_s, cpu_s = self.stats.calls.totals()
        if reads < _DECIDE_READS or time.perf_counter() - self._first_at < _DECIDE_S:
            return
        if cpu_s / reads >= _PROCESS_MIN_READ_CPU_S and self._readers_travel():
            self._to_processes(wall_s / cpu_s)
        self._settle()

    def _readers_travel(self) -> bool:
        """Whether the open readers' input elements and positions can be sent to a worker, and
        what they read can be sent back (a sample of it). Where not (an open file object, a
        lock), the pipeline stays on threads."""
        places, read = self._threads.sample_readers(_SAMPLED_ITEMS)
        try:
            pickle.dumps(places, pickle.HIGHEST_PROTOCOL)
            for value in read:
                codec.encode(value)  # tensors are not copied: only the rest is pickled
        except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
            return False
        return True

    def _settle(self) -> None:
        """The choice is made: shut down the iterator not chosen."""
        self._deciding = False
        if self._current is not self._processes and self._processes is not None:
            self._processes.shutdown()
            self._processes = None

    def _to_processes(self, wall_per_cpu: float) -> None:
        """Hand the pass over; with AUTOTUNE, start at the reads in flight that would keep every
        core busy if reading were all there was (the autotuner takes it from there)."""
        handover = self._threads.hand_over()
        self._threads.shutdown()
        self._threads = None
        processes = self._processes
        processes.start()
        processes.take_over(handover)
        self._current = processes
        knob: LiveKnob | None = handover.knob
        if knob is not None:
            knob.request(max(knob.value, round(usable_cpu_count() * wall_per_cpu)))
            knob.take_request()

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

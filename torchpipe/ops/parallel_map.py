"""The parallel ``map`` iterator: calls in flight on threads or worker processes, in input order.

It chooses its executor when asked to (``executor="auto"``, see ``docs/executors.md``) and is
resized by the autotuner while it runs (``num_parallel_calls=AUTOTUNE``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from torchpipe.ops.base import Iterator, PositionLog
from torchpipe.ops.filter import DROPPED
from torchpipe.ops.stats import LiveKnob, element_bytes
from torchpipe.randomness import global_rng_states, restore_global_rng_states
from torchpipe.runtime.codec import materialize
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.executor import Executor, ThreadExecutor
from torchpipe.runtime.gil import gil_free_fraction, steady_gil_free_fraction
from torchpipe.runtime.process_pool import ProcessPool, process_executor_supported
from torchpipe.runtime.timing import CallTiming

_WAIT_S = 0.5
# executor="auto": calls measured inline before choosing, and what makes processes worth it.
_PROBE_ELEMENTS = 8
_PROBE_SECONDS = 0.02
_PROCESS_MIN_CALL_S = 50e-6
_GIL_FREE_FOR_THREADS = 0.5
# Large results: workers send them without a copy on this side, so threads must leave the GIL
# almost always free to match them (threads batch into reused memory: no page faults here).
_LARGE_RESULT_BYTES = 1 << 20
# Their first calls (page faults, warm-up) and other threads' bursts of Python make the GIL look
# busier than it is: the least disturbed of this many more calls, each measured on its own, decides.
_LARGE_PROBE_CALLS = 4
# Beside the bench's monitor thread: bigtensor 0.94-1.0 (9 of 12 >= 0.95), jpeg's batches 0.79-0.93.
_GIL_FREE_FOR_LARGE = 0.95
_PROBE_THREADS = 3  # calls per thread in the two-thread trial
_PROBE_BASELINE = 3  # calls timed one at a time (without the GIL probe) just before it
_THREAD_SPEEDUP = 1.3  # below this, two threads are not worth it: the function holds the GIL
_CHECK_RESULTS, _CHECK_S = 16, 0.3  # threads chosen by the trial are confirmed after this much work
MAX_THREADS = 64
"""The most threads the autotuner gives a parallel stage (functions that wait on I/O want many)."""


class _ThreadCheck:
    """What confirming a choice of threads measures: results delivered and time the consumer waited."""

    def __init__(self, per_call: float, waited: float) -> None:
        self.per_call = per_call
        self.start = time.perf_counter()
        self.results = 0
        self.waited_before = waited

    def slow(self, waited: float) -> bool:
        """The consumer mostly waited (``waited`` seconds in all), and threads delivered less than
        ``_THREAD_SPEEDUP`` calls' worth per call time."""
        elapsed = time.perf_counter() - self.start
        slow_delivery = self.results * self.per_call / elapsed < _THREAD_SPEEDUP
        return waited - self.waited_before > 0.5 * elapsed and slow_delivery


class ParallelMapIterator(Iterator):
    """Keeps up to the executor's capacity of calls in flight on threads or worker processes.

    Input elements are pulled on the consumer's thread and numbered; results are delivered in
    that order, or as they complete when not deterministic. The checkpoint is the input's
    position before the oldest undelivered element (see ``PositionLog``); in-flight calls
    are recomputed on resume.

    ``executor="auto"`` runs the first few elements inline while measuring how much of the
    time the function holds the GIL, then picks processes for functions that hold it and cost
    at least ~50 us a call or that return 1 MB or more, and threads otherwise (see
    ``docs/executors.md``).

    With ``tunable`` (``num_parallel_calls=AUTOTUNE``) the autotuner resizes the pool while it
    runs; calls in flight finish, and elements keep their sequence numbers, so nothing is lost,
    repeated or reordered.
    """

    tuning_role = "pool"

    def __init__(
        self,
        name: str,
        source: Iterator,
        *,
        in_threads: Callable[[int, Any], Any],
        in_processes: Callable[[int, Any], Any],
        parallelism: int,
        deterministic: bool,
        executor: str,
        restart: bool,
        tunable: bool = False,
        learned: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name, source)
        # What earlier passes settled on: start there (no probe; no climb from the cores).
        self._learned = learned if learned is not None else {}
        if executor == "auto" and self._learned.get("executor") in ("thread", "process"):
            executor = self._learned["executor"]
        if tunable:
            parallelism = self._learned.get("parallelism", parallelism)
        self.stats.calls = CallTiming()
        self._log = PositionLog(source)
        self._tasks = {"thread": in_threads, "process": in_processes}
        self._parallelism = parallelism
        self._deterministic = deterministic
        self._kind = executor if executor != "process" or process_executor_supported() else "thread"
        self._restart = restart
        self._pool: ProcessPool | None = None
        self._executor: Executor | None = None
        self._order: deque[int] = deque()
        self._done: dict[int, tuple[Any, BaseException | None]] = {}
        self._exhausted = False
        self._check: _ThreadCheck | None = None
        self._knob: LiveKnob | None = None
        if tunable:
            most = max(MAX_THREADS, 2 * usable_cpu_count())
            self._knob = LiveKnob(f"{name}.parallelism", parallelism, 1, most, False, self._resize)

    @property
    def executor_kind(self) -> str:
        """``thread`` or ``process`` once chosen; ``auto`` before the first element."""
        return self._kind

    def knobs(self) -> list[LiveKnob]:
        return [self._knob] if self._knob is not None else []

    def parallelism(self) -> int:
        return self._parallelism

    def buffer_slots(self) -> int:
        return self._executor.capacity if self._executor is not None else self._parallelism

    def calls_in_processes(self) -> bool:
        return self._kind == "process"

    def _resize(self, size: int) -> None:
        self._parallelism = size
        self._learned["parallelism"] = size
        if self._executor is not None:
            self._executor.resize(size)

    def _set_kind(self, kind: str) -> None:
        self._kind = kind
        if self._knob is not None:  # processes beyond twice the cores only cost memory
            self._knob.maximum = MAX_THREADS if kind == "thread" else 2 * usable_cpu_count()

    def prepare(self) -> None:
        super().prepare()
        if self._kind in ("process", "auto") and process_executor_supported() and self._pool is None:
            self._pool = ProcessPool(self._tasks["process"], self._parallelism, self.name, restart=self._restart,
                                     timing=self.stats.calls)  # fmt: skip

    def start(self) -> None:
        if self._kind == "auto":
            self._choose_executor()
        elif self._kind == "process":
            self.prepare()
            self._use_processes()
        else:
            self._use_threads()

    def _choose_executor(self) -> None:
        """Run a few elements inline under a GIL probe, keep their results, pick an executor.

        They run as a worker would run them (global RNGs seeded per element), so the caller's
        global RNG states are put back afterwards.
        """
        saved = global_rng_states()
        try:
            measured, free, seconds = gil_free_fraction(self._run_inline)
            large = self._pool is not None and self._mean_result_bytes() >= _LARGE_RESULT_BYTES
            if large:  # decided by the probe alone (no trial), so from steadier numbers
                _, free, _ = steady_gil_free_fraction(lambda: self._run_inline(1), _LARGE_PROBE_CALLS)
        finally:
            restore_global_rng_states(saved)
        per_call = seconds / max(measured, 1)
        if self._pool is not None:
            free_enough = _GIL_FREE_FOR_LARGE if large else _GIL_FREE_FOR_THREADS
            holds_gil = per_call >= _PROCESS_MIN_CALL_S and free < free_enough
            if per_call >= _PROCESS_MIN_CALL_S and not (large or holds_gil):
                # Many short GIL releases (small torch ops) fool the probe: check that two threads
                # really run faster than one.
                holds_gil = self._thread_speedup(per_call) < _THREAD_SPEEDUP
            if holds_gil:
                self._use_processes()
                return
        self._use_threads()
        if self._pool is not None and per_call >= _PROCESS_MIN_CALL_S:
            self._check = _ThreadCheck(per_call, self.stats.wait_s)  # the trial can mislead: confirm it
            return
        self._learned["executor"] = "thread"
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _use_processes(self) -> None:
        self._pool.resize(self._parallelism)
        self._executor = self._pool
        self._set_kind("process")
        self._learned["executor"] = "process"

    def _use_threads(self) -> None:
        self._executor = ThreadExecutor(self._tasks["thread"], self._parallelism, self.name, self.stats.calls)
        self._set_kind("thread")

    def _confirm_threads(self) -> None:
        """Once threads have run a while: if this stage held the consumer up and threads ran no
        faster than one call at a time should, finish their calls and move to the processes."""
        check = self._check
        if check.results < _CHECK_RESULTS or time.perf_counter() - check.start < _CHECK_S:
            return
        self._check = None
        if check.slow(self.stats.wait_s):
            threads = self._executor
            while any(seq not in self._done for seq in self._order):
                for seq, value, error in threads.collect(_WAIT_S):
                    self._done[seq] = (value, error)
            threads.close()
            self._use_processes()
        else:
            self._learned["executor"] = "thread"
            self._pool.close()
            self._pool = None

    def _thread_speedup(self, per_call: float) -> float:
        """Run the next few elements on two threads; their speed-up over one call at a time.

        The one-at-a-time cost is timed again right before (the fastest of a few calls), without
        the GIL probe running beside it, which slows calls down and would flatter the threads. Only where calls do
        not seed the global RNGs (threads would race on them), else 2.
        """
        task = self._tasks["thread"]
        if getattr(getattr(self._tasks["process"], "fn", None), "seeds_globals", False):
            return 2.0
        timings = []
        for _ in range(_PROBE_BASELINE):  # the fastest single call: noise only ever slows one down
            t0 = time.perf_counter()
            if self._run_inline(1):
                timings.append(time.perf_counter() - t0)
        if timings:
            per_call = min(timings)
        trial = ThreadExecutor(task, 2, self.name, self.stats.calls)
        try:
            pending = set()
            t0 = time.perf_counter()
            while len(pending) < 2 * _PROBE_THREADS and not self._exhausted:
                seq, payload = self._pull()
                if seq is not None:
                    trial.submit(seq, payload)
                    pending.add(seq)
            count = len(pending)
            while pending:
                for seq, value, error in trial.collect(_WAIT_S):
                    self._done[seq] = (value, error)
                    pending.discard(seq)
            seconds = time.perf_counter() - t0
        finally:
            trial.close()
        return count * per_call / seconds if count else 2.0

    def _mean_result_bytes(self) -> float:
        """Tensor and array bytes per result among those computed inline so far."""
        sizes = [element_bytes(value) for value, error in self._done.values() if error is None]
        return sum(sizes) / len(sizes) if sizes else 0.0

    def _run_inline(self, limit: int = _PROBE_ELEMENTS) -> int:
        task, count, deadline = self._tasks["process"], 0, None
        while count < limit and not self._exhausted:
            seq, payload = self._pull()
            if seq is None:
                continue
            try:
                self._done[seq] = (materialize(task(seq, payload)), None)
            except Exception as e:  # noqa: BLE001 - delivered in its place, like a worker's
                self._done[seq] = (None, e)
            count += 1
            deadline = deadline or time.perf_counter() + _PROBE_SECONDS
            if time.perf_counter() > deadline:
                break
        return count

    def _pull(self) -> tuple[int | None, Any]:
        """Pull and number one input element; an input error is recorded as that element's result."""
        try:
            seq, element, error = self._log.pull()
        except StopIteration:
            self._exhausted = True
            return None, None
        self._order.append(seq)
        if error is not None:
            self._done[seq] = (None, error)
            return None, None
        return seq, element

    def _fill(self) -> None:
        while not self._exhausted and len(self._order) < self._executor.capacity:
            seq, payload = self._pull()
            if seq is not None:
                self._executor.submit(seq, payload)

    def next(self) -> Any:
        if self._knob is not None:
            self._knob.take_request()
        while True:
            self._fill()
            if not self._order:
                raise StopIteration
            seq = self._wait(self._order[0] if self._deterministic else None)
            self._order.remove(seq)
            self.stats.look(len(self._done), self._executor.capacity)
            value, error = self._done.pop(seq)
            self._log.delivered(seq)
            if self._check is not None:
                self._check.results += 1
                self._confirm_threads()
            if error is not None:
                raise error
            if value is not DROPPED:  # a fused filter said no
                self.stats.sample_bytes(value)
                return value

    def _wait(self, seq: int | None) -> int:
        """Wait until element ``seq`` (or, if None, any element) has finished."""
        while True:
            if seq is None and self._done:
                return next(iter(self._done))
            if seq is not None and seq in self._done:
                return seq
            t0 = time.perf_counter()
            for done_seq, value, error in self._executor.collect(_WAIT_S):
                self._done[done_seq] = (value, error)
            self.stats.wait_s += time.perf_counter() - t0

    def get_state(self) -> dict[str, Any]:
        return self._log.state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._log.set_state(state)

    def shutdown(self) -> None:
        for executor in {id(e): e for e in (self._executor, self._pool) if e is not None}.values():
            executor.close()
        self._executor = self._pool = None
        self._done.clear()
        self._order.clear()

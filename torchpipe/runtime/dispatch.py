"""Ordered delivery over any executor: the one dispatcher every parallel op runs its calls through.

A parallel op (map, the DataLoader's batches, an interleave's reads) numbers its tasks and hands
them to a :class:`Dispatcher`, which sends them to its executor (inline, threads or processes),
collects what finishes, and gives results back in sequence order, or as they complete. Every wait
is bounded: it polls in short steps, gives up at a caller's deadline, and a task out for longer
than the stage's stall limit raises :class:`~torchpipe.errors.StallError` naming the stage, the
element and where it runs.

The executor can be swapped while tasks are in flight (:meth:`Dispatcher.switch`): tasks already
sent finish where they are, new ones go to the new executor, and results keep their sequence
numbers, so nothing is lost, repeated or reordered. Tasks another thread sent to an executor
ahead of the dispatcher (:meth:`Dispatcher.adopt`: a worker started while the first call was
measured) are delivered in their places the same way.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torchpipe.runtime.executor import Executor
from torchpipe.runtime.stall import StallWatch

_POLL_S = 0.5  # one wait's step: the stall limit and deadlines are checked between steps
_DRAIN_POLL_S = 0.005  # a step while a switched-out executor still has tasks (they are few)


class Dispatcher:
    """Tasks numbered by the caller, run on an executor, delivered in order or as completed.

    Args:
        stage: the stage name, for errors.
        executor: where tasks run.
        stall_s: raise :class:`StallError` when the oldest undelivered task has been out this many
            seconds (None: never).
    """

    def __init__(self, stage: str, executor: Executor, stall_s: float | None = None) -> None:
        self.stage = stage
        self.executor = executor
        self._draining: list[tuple[Executor, Callable[[Executor], None] | None]] = []
        self._order: deque[int] = deque()  # every task not yet delivered, in sequence order
        self._done: dict[int, tuple[Any, BaseException | None]] = {}
        self._sent = StallWatch(stage, stall_s)  # the tasks in flight, and since when
        self.wait_s = 0.0  # seconds spent waiting for results

    @property
    def pending(self) -> int:
        """Tasks submitted (or results put) and not yet delivered."""
        return len(self._order)

    @property
    def finished(self) -> int:
        """Results waiting to be delivered."""
        return len(self._done)

    @property
    def draining(self) -> bool:
        """Whether an executor the tasks were switched from still runs some."""
        return bool(self._draining)

    def has_room(self) -> bool:
        """Whether another task fits in the executor's window."""
        return len(self._order) < self.executor.capacity

    def submit(self, seq: int, payload: Any, **route: Any) -> None:
        """Run ``payload`` as task ``seq`` (sequence numbers increase with every call); ``route``
        goes to the executor's ``submit`` (a process pool's ``slot`` or ``prefer``)."""
        self._order.append(seq)
        self._sent.begin(seq)
        self.executor.submit(seq, payload, **route)

    def began(self, seq: int) -> None:
        """Task ``seq``, in flight, starts its own work about now (it waited for another task
        first, as a process interleave's chunk waits for the chunk before it): its stall clock
        starts again."""
        self._sent.again(seq)

    def put(self, seq: int, value: Any, error: BaseException | None = None) -> None:
        """Deliver ``value`` (or raise ``error``) in ``seq``'s place: a result computed elsewhere."""
        self._expect(seq)
        self._done[seq] = (value, error)

    def adopt(
        self,
        executor: Executor,
        seqs: list[int],
        retire: Callable[[Executor], None] | None = None,
    ) -> None:
        """Deliver in their places tasks ``seqs`` that were submitted to ``executor`` without this
        dispatcher (ahead of it, from another thread); an executor that is not this dispatcher's
        is handed to ``retire`` once they are done, as one switched from is (unless switched to
        before)."""
        for seq in seqs:
            self._expect(seq)
            self._sent.begin(seq)
        if executor is not self.executor and all(e is not executor for e, _ in self._draining):
            self._draining.append((executor, retire))

    def _expect(self, seq: int) -> None:
        """Deliver ``seq`` in sequence order, though it may come after later ones (put or adopted)."""
        if self._order and seq < self._order[-1]:
            self._order.insert(bisect.bisect(self._order, seq), seq)
        else:
            self._order.append(seq)

    def take(
        self, in_order: bool = True, deadline: float | None = None
    ) -> tuple[int, Any, BaseException | None]:
        """The next result, ``(seq, value, error)``: the oldest task's when ``in_order``, else any
        finished one, waiting for it in bounded steps.

        Raises:
            LookupError: if nothing is pending.
            TimeoutError: once ``deadline`` (a ``time.monotonic()`` value) has passed.
            StallError: if the oldest task has been out longer than the stall limit.
        """
        if not self._order:
            raise LookupError(f"{self.stage}: no task is pending")
        while True:
            seq = self._ready(in_order)
            if seq is not None:
                if seq == self._order[0]:
                    self._order.popleft()
                else:
                    self._order.remove(seq)  # as completed: rare, and the window is small
                value, error = self._done.pop(seq)
                return seq, value, error
            self._check_stall()
            step = _DRAIN_POLL_S if self._draining else _POLL_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.stage}: no result within the time allowed")
                step = min(step, left)
            self.collect(step)

    def poll(self, timeout: float) -> list[tuple[int, Any, BaseException | None]]:
        """Every result finished now, as completed, waiting up to ``timeout`` s for one (for ops
        that route results themselves, as an interleave routes chunks to their readers).

        Raises:
            StallError: if the oldest task has been out longer than the stall limit.
        """
        if not self._done:
            self.collect(timeout)
        if not self._done:
            self._check_stall()
        results = [(seq, *self._done.pop(seq)) for seq in list(self._done)]
        if results:
            taken = {seq for seq, _, _ in results}
            self._order = deque(seq for seq in self._order if seq not in taken)
        return results

    def collect(self, timeout: float) -> int:
        """Gather finished results, waiting up to ``timeout`` s for the first; how many came."""
        t0 = time.perf_counter()
        count = 0
        waiter = self._waiter()
        for executor, _ in self._draining:
            count += self._gather(
                executor.collect(timeout if executor is waiter and not count else 0.0)
            )
        count += self._gather(
            self.executor.collect(timeout if self.executor is waiter and not count else 0.0)
        )
        if self._draining:
            self._draining = [
                (e, retire) for e, retire in self._draining if not self._retire(e, retire)
            ]
        self.wait_s += time.perf_counter() - t0
        return count

    def switch(self, executor: Executor, retire: Callable[[Executor], None] | None = None) -> None:
        """Send new tasks to ``executor``; tasks in flight finish on the old one, which is then
        handed to ``retire`` (default: closed). An executor switched back to while it was still
        finishing tasks is no longer retired."""
        old, self.executor = self.executor, executor
        self._draining = [(e, retire) for e, retire in self._draining if e is not executor]
        if old is not executor and not self._retire(old, retire):
            self._draining.append((old, retire))

    def forget(self) -> None:
        """Drop every pending task and result (a pass broken off); executors keep running, and
        results of the dropped tasks that still arrive are ignored."""
        self._order.clear()
        self._done.clear()
        self._sent.clear()

    def close(self) -> None:
        """Close the executors and drop every pending task and result."""
        for executor in [*(e for e, _ in self._draining), self.executor]:
            executor.close()
        self._draining.clear()
        self.forget()

    def _ready(self, in_order: bool) -> int | None:
        if in_order:
            seq = self._order[0]
            return seq if seq in self._done else None
        return next(iter(self._done), None)

    def _waiter(self) -> Executor:
        """The executor to wait on for the next result: the current one, unless it holds no task
        in flight and a switched-out one does. An inline executor returns at once: waiting on it
        while threads finished a trial's tasks spun the loop, ~100 looks a result, holding the
        GIL the threads needed (`records`' DataLoader: 2.5 ms a batch, against 0.6 inline)."""
        if not self._draining:
            return self.executor
        out = self._sent.seqs()
        if any(self.executor.holds(seq) for seq in out):
            return self.executor
        return next(
            (e for e, _ in self._draining if any(e.holds(seq) for seq in out)), self.executor
        )

    def _gather(self, results: list[tuple[int, Any, BaseException | None]]) -> int:
        count = 0
        for seq, value, error in results:
            if self._sent.end(seq):  # not a late result of a dropped task
                self._done[seq] = (value, error)
                count += 1
        return count

    def _retire(self, executor: Executor, retire: Callable[[Executor], None] | None) -> bool:
        """Retire ``executor`` if none of the tasks in flight runs there; whether it was."""
        if any(executor.holds(seq) for seq in self._sent.seqs()):
            return False
        (retire or type(executor).close)(executor)
        return True

    def _check_stall(self) -> None:
        self._sent.check(self._where)

    def _where(self, seq: int) -> str:
        executors = [self.executor, *(e for e, _ in self._draining)]
        return next((e.where(seq) for e in executors if e.holds(seq)), "an executor")

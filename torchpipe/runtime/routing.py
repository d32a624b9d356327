"""Central dispatch: which worker runs each queued task, written once for every pool.

A pool (worker processes, Ray actors) numbers its tasks and keeps them in a :class:`TaskRouter`
until a worker can take them. :meth:`TaskRouter.route` hands them out in order: a task bound to
a slot goes to that slot's worker (in order: later tasks of the slot wait behind it), a task
that prefers a slot goes to that slot's worker while it has one (waiting while it is busy or
starting), and any other task goes to the ready worker with the fewest in flight; no worker takes
more than ``limit``. A dead worker's tasks come back with :meth:`TaskRouter.requeue`, ahead of
the later ones, and an element that keeps killing workers is found by :meth:`TaskRouter.failed`.
The pool sends what was routed and owns everything about its workers (how they start, what a
message is, how a death is noticed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, TypeVar

MAX_TASK_FAILURES = 3
"""Workers an element may kill (or be lost with) before the pool raises instead of trying again."""


class Task(NamedTuple):
    """One task: its sequence number, its payload, the slot it must run in and the one it prefers."""

    seq: int
    payload: Any
    slot: int | None = None
    prefer: int | None = None


class Routable(Protocol):
    """What the router reads of a worker."""

    slot: int  # 0..size-1: the worker's place in the pool; a replacement takes it over
    tasks: dict[int, Any]  # in flight: seq -> whatever the pool keeps of it
    retiring: bool  # finishing its tasks, taking no more
    ready: bool  # able to take tasks (a Ray actor is not until its installation answered)


W = TypeVar("W", bound=Routable)


class TaskRouter:
    """The tasks a pool holds that no worker runs yet, and the rule that gives them to workers."""

    def __init__(self) -> None:
        self._queued: deque[Task] = deque()
        self._failures: dict[int, int] = {}  # seq -> workers it was lost with so far

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, task: Task) -> None:
        """Queue ``task`` behind the others."""
        self._queued.append(task)

    def holds(self, seq: int) -> bool:
        """Whether task ``seq`` waits here."""
        return any(task.seq == seq for task in self._queued)

    def route(
        self,
        workers: Iterable[W],
        limit: int,
        slot_of: Callable[[int], int] | None = None,
        held: Callable[[W], int] | None = None,
    ) -> list[tuple[W, Task]]:
        """Take the queued tasks that a worker can run now, in order, each with its worker.

        Args:
            workers: the pool's workers (retiring ones and ones not ready take nothing).
            limit: the most tasks a worker may have in flight.
            slot_of: maps a task's preferred slot to a worker's (e.g. modulo the pool's size);
                None: the same number.
            held: how many of a worker's results the consumer still holds (a process's ring
                records): of the workers with the fewest in flight, the one holding the fewest
                takes the task, so that no ring fills while another's slots are free.
        """
        live = [w for w in workers if not w.retiring]
        by_slot = {w.slot: w for w in live}
        ready = [w for w in live if w.ready]
        load = {id(w): len(w.tasks) for w in live}
        kept_by = {id(w): held(w) for w in live} if held is not None else None
        routed: list[tuple[W, Task]] = []
        blocked: set[int] = set()
        kept: deque[Task] = deque()
        for task in self._queued:
            worker = _pick(task, by_slot, ready, load, slot_of, kept_by)
            if (
                worker is None
                or not worker.ready
                or load[id(worker)] >= limit
                or _blocked(task, blocked)
            ):
                if task.slot is not None:
                    blocked.add(task.slot)  # later tasks of the slot wait too, to keep its order
                kept.append(task)
                continue
            load[id(worker)] += 1
            routed.append((worker, task))
        self._queued = kept
        return routed

    def requeue(self, tasks: Iterable[Task]) -> None:
        """Queue ``tasks`` again (a dead worker's, or ones that could not be sent), each ahead of
        every queued task with a later sequence number: they were due first."""
        queued = list(self._queued)
        for task in sorted(tasks, key=lambda t: t.seq):
            at = next(
                (i for i, waiting in enumerate(queued) if waiting.seq > task.seq), len(queued)
            )
            queued.insert(at, task)
        self._queued = deque(queued)

    def failed(self, seq: int) -> bool:
        """Count one worker lost while running task ``seq``; whether that makes ``MAX_TASK_FAILURES``."""
        self._failures[seq] = self._failures.get(seq, 0) + 1
        return self._failures[seq] >= MAX_TASK_FAILURES

    def done(self, seq: int) -> None:
        """Task ``seq`` has its result: forget its failures."""
        self._failures.pop(seq, None)

    def clear(self) -> None:
        """Drop every queued task."""
        self._queued.clear()


def _blocked(task: Task, blocked: set[int]) -> bool:
    return task.slot is not None and task.slot in blocked


def _pick(
    task: Task,
    by_slot: dict[int, W],
    ready: list[W],
    load: dict[int, int],
    slot_of: Callable[[int], int] | None,
    held: dict[int, int] | None = None,
) -> W | None:
    """The worker for ``task``: its slot's, its preferred slot's while that has one, else the
    ready one with the fewest tasks in flight, of those the one whose results the consumer
    holds fewest of (None: it waits)."""
    if task.slot is not None:
        return by_slot.get(task.slot)
    if task.prefer is not None:
        slot = slot_of(task.prefer) if slot_of is not None else task.prefer
        if slot in by_slot:
            return by_slot[slot]
    if held is None:
        return min(ready, key=lambda w: load[id(w)], default=None)
    return min(ready, key=lambda w: (load[id(w)], held[id(w)]), default=None)

"""What a DataLoader holds of its own, read on a thread of its own, against a budget.

What counts (docs/autotune.md, "What a loader's memory budget counts"): the pages its worker
processes and their zygote hold alone (a worker's heap, a batch it has made and not handed over),
the rings batches travel in, and the batches made on this process's threads and not handed out,
with the memory kept for the next (a batch handed out is the loop's, as with torch's workers).
A model of it would miss what matters (a worker's heap after its first batches, what
the zygote keeps of pages this process rewrote since), so it is read from
``/proc/<pid>/smaps_rollup``: a reading of a process with torch loaded costs a few milliseconds,
so a watcher thread takes it (the file's reads let go of the GIL) and the consumer only looks at
its verdict. Readings miss what comes between them, so the budget is held on a prediction of the
peak built from them (:func:`predicted_peak`): the slots start released, and ``"auto"`` caps its
workers, before workers are added, not after a reading has seen the overshoot.

The budget is ``autotune=tp.AutotuneOptions(ram_budget=...)`` where given, else
:data:`DEFAULT_SHARE` of the memory available when the loader's first epoch starts. With
``num_workers="auto"`` the loader sheds workers, then ring slots, past it; an explicit
``num_workers`` is the user's and is never lowered: past the default budget it warns once.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torchpipe.autotune.tuner import RAM_SHARE, Budget
from torchpipe.runtime.heap import trim_heap
from torchpipe.runtime.processes.output import slot_bytes

DEFAULT_SHARE = RAM_SHARE
"""The share of the memory available when a loader first starts that it keeps what it holds
under, unless ``ram_budget`` is given: a pipeline's default (tf.data's autotuner takes the same)."""
CHECK_EVERY_S = 0.25
"""How often the loader's memory is read while it holds more than half its budget."""
RELAXED_CHECK_EVERY_S = 2.0
"""How often it is read while it holds less than half and has stopped growing (a reading costs a
few ms of a thread): a loader starting its workers and filling its rings is read every
:data:`CHECK_EVERY_S`, or a budget it passes in its first seconds would be seen seconds late."""
GROWING = 1.125
"""A reading this many times the last one or more: the loader is still growing."""
SETTLE_S = 1.0
"""How long after shedding a worker or a slot readings wait (a retiring worker takes time to go)."""
ROOM_SHARE = 0.8
"""Slots released for a budget keep their pages again once what the loader holds, and all its
slots' pages with it, is within this share of the budget (not at once past it again)."""
MAX_PROCESSES = 256
"""The processes whose most held alone a loader remembers (a pool's, and those it replaced last)."""
MIN_RING_BYTES = 1 << 20
"""The least a worker's rings may hold under a given budget (results beyond take one-off segments)."""
_PRIVATE = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")
_PSS_SHMEM = b"Pss_Shmem:"


def private_bytes(pid: int, ring_resident: int = 0) -> int:
    """The pages process ``pid`` holds alone (its USS), in bytes, but those of its rings (whose
    resident bytes are ``ring_resident``): 0 where it is gone or unreadable. A forked worker
    shares every page it has not written with the process it was forked from: those cost
    nothing more.

    A ring's page the worker wrote and this process has not read yet is mapped by the worker
    alone, so it counts among its private pages; the rings are counted apart, by their resident
    pages, so such a page would count twice (with slots that give their pages back, every result
    in flight: a jpeg loader with 2 workers read 132 MiB where its tree held 90). A page both
    map counts half in the worker's ``Pss_Shmem``, one it maps alone whole, so of its rings'
    ``ring_resident`` bytes it holds ``2 * Pss_Shmem - ring_resident`` alone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            lines = [line.split() for line in f if line.startswith((*_PRIVATE, _PSS_SHMEM))]
    except OSError:
        return 0
    private = sum(int(v) * 1024 for k, v, *_ in lines if k in _PRIVATE)
    shmem = sum(int(v) * 1024 for k, v, *_ in lines if k == _PSS_SHMEM)
    in_rings = min(shmem, ring_resident, max(0, 2 * shmem - ring_resident))
    return private - in_rings


def default_budget() -> float:
    """:data:`DEFAULT_SHARE` of the memory available now, in bytes (a pipeline's default RAM budget)."""
    return Budget.of_machine().ram


def ring_limit(ram_budget: float, workers: int) -> int:
    """The most a worker's rings may hold under ``ram_budget``: half the budget shared by the
    ``workers`` a loader starts with (results beyond travel in one-off segments, freed once used).
    More workers than that, or rings and heaps past the budget, are shed by its readings.
    A quarter shared by the most workers there may be (2 a core) left jpeg's 9.6 MB batches no
    slot under a 154 MB budget: every batch paid its pages' faults, and processes lost to threads."""
    return max(MIN_RING_BYTES, int(ram_budget / (2 * max(workers, 1))))


def workers_within(held: float, budget: float, workers: int) -> int:
    """How many of ``workers`` to keep (at least one) for a loader that holds ``held`` bytes to
    come within ``budget``, each worker taken to hold an equal share: a loader started past a small
    budget gives up all it must at the first reading, not a worker a second."""
    each = held / max(workers, 1)
    past = math.ceil((held - budget) / each) if each > 0 and held > budget else 0
    return max(1, workers - max(past, 1))


Holdings = Callable[[], "tuple[list[int], float, dict[int, int]] | None"]
"""What a loader holds now: its processes' pids, the bytes of its rings' resident pages and of
what it holds in this process, and each worker's rings' resident bytes by pid; None once it is
gone."""


class LoaderMemory:
    """What a loader holds, read by a watcher thread, against ``budget`` bytes.

    Args:
        budget: the budget in bytes.
        given: whether the user gave it (``ram_budget``) or it is the default.

    Attributes:
        held: bytes held at the last reading; peak: the most read; over: whether the last
            reading (taken :data:`SETTLE_S` or more after the last :meth:`shed`) was past the budget.
    """

    def __init__(self, budget: float, given: bool) -> None:
        self.budget, self.given = budget, given
        self.held = self.peak = 0.0
        self.alone: dict[int, float] = {}  # the most each of its processes was read to hold alone
        self.readings = self._judged = 0  # readings taken; the last one judged on the peak
        self._last = 0.0  # the reading before the last
        self.over = False
        self.shed_steps: list[str] = []  # what was given up, in order, for stats()
        self.slot_pages, self.slot_pages_why = "kept", "no budget has bound"  # for stats()
        self.in_flight: int | None = None  # batches in flight a worker, once a budget set them
        self.in_flight_why = "no budget has bound"
        self.warned = False
        self._settled_at = 0.0
        self._stop = threading.Event()
        self._key = 0
        self._thread: threading.Thread | None = None

    def read(
        self, pids: list[int], shared_bytes: float, rings: dict[int, int] | None = None
    ) -> float:
        """Take a reading: the pages processes ``pids`` hold alone (but their rings' pages, whose
        resident bytes ``rings`` gives by pid: :func:`private_bytes`), and ``shared_bytes`` (the
        rings' resident pages, and what the loader holds in this process)."""
        taken = time.monotonic()
        rings = rings or {}
        alone = [private_bytes(pid, rings.get(pid, 0)) for pid in pids]
        held = float(sum(alone) + shared_bytes)
        self._last, self.held, self.peak = self.held, held, max(self.peak, held)
        if len(self.alone) > 4 * MAX_PROCESSES:  # workers come and go: keep the last ones'
            self.alone = dict(list(self.alone.items())[-MAX_PROCESSES:])
        for pid, nbytes in zip(pids, alone):
            self.alone[pid] = max(self.alone.get(pid, 0.0), float(nbytes))
        self.readings += 1
        self.over = held > self.budget and taken >= self._settled_at
        return held

    def watch(self, holdings: Holdings, key: int) -> threading.Event:
        """Read ``holdings()`` on a daemon thread until the returned event is set or it returns
        None. ``key`` names what is watched (a pool): watching it again keeps the thread; watching
        another stops the last one's."""
        if (
            self._key == key
            and self._thread is not None
            and self._thread.is_alive()
            and not self._stop.is_set()
        ):
            return self._stop
        self._stop.set()
        self._stop, self._key = threading.Event(), key
        self._thread = threading.Thread(
            target=self._run,
            args=(holdings, self._stop),
            name="torchpipe-loader-memory",
            daemon=True,
        )
        self._thread.start()
        return self._stop

    def shed(self, step: str) -> None:
        """Note that ``step`` was given up; readings wait :data:`SETTLE_S` before judging again."""
        self.shed_steps.append(step)
        self.settle()

    def settle(self) -> None:
        """Something changed what the loader holds: readings wait :data:`SETTLE_S` to judge again."""
        self.over = False
        self._settled_at = time.monotonic() + SETTLE_S

    def room_for(self, extra: float) -> bool:
        """Whether what the loader holds and ``extra`` bytes more are within :data:`ROOM_SHARE` of
        the budget, at a reading taken after the last change settled."""
        return self.settled and self.held > 0 and self.held + extra <= ROOM_SHARE * self.budget

    @property
    def settled(self) -> bool:
        """Whether the last change to what the loader holds has had :data:`SETTLE_S` to show."""
        return time.monotonic() >= self._settled_at

    def new_reading(self) -> bool:
        """Whether a reading came since the last call (the peak is judged once a reading)."""
        fresh, self._judged = self.readings != self._judged, self.readings
        return fresh

    def report(self) -> dict[str, Any]:
        """For ``loader.stats()``: the ``budget`` and whether it is the ``default``, the bytes
        ``held`` at the last reading and at the ``peak``, and what was ``shed`` to keep to it."""
        return {
            "budget": int(self.budget),
            "default": not self.given,
            "held": int(self.held),
            "peak": int(self.peak),
            "shed": list(self.shed_steps),
            "slot_pages": self.slot_pages,
            "slot_pages_why": self.slot_pages_why,
            "in_flight": self.in_flight,
            "in_flight_why": self.in_flight_why,
        }

    def _run(self, holdings: Holdings, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                now = holdings()
            # the workers or rings changed while they were listed (a ring closed): next time
            except (RuntimeError, ValueError, OSError):
                now = ([], 0.0, {})
            if now is None:
                return
            if now[0] or now[1]:
                self.read(*now)
            stop.wait(self.next_reading_in())

    def next_reading_in(self) -> float:
        """How long until the next reading: long only while far from the budget and not growing."""
        steady = 0 < self.held < GROWING * self._last
        return RELAXED_CHECK_EVERY_S if steady and self.held < self.budget / 2 else CHECK_EVERY_S


def pool_holdings(pool: Any, here: Callable[[], float] | None = None) -> Holdings:
    """:data:`Holdings` of a process pool, held weakly (the watcher must not keep it alive), and
    the bytes ``here()`` says the loader holds in this process (batches made here and not handed
    out, memory kept for the next ones)."""
    ref = weakref.ref(pool)

    def holdings() -> tuple[list[int], float, dict[int, int]] | None:
        live = ref()
        if live is None:
            return None
        rings = live.ring_residency
        return (
            list(live.process_ids),
            float(sum(rings.values())) + (here() if here is not None else 0.0),
            rings,
        )

    return holdings


def release_slot_pages(memory: LoaderMemory, pool: Any) -> bool:
    """The first step past the budget, before any worker goes: the workers' slots give their
    pages back once their batch is released, and the workers and this process their free heap
    (memory buys workers: the loader then holds about what torch's DataLoader holds with as many
    workers, paying the page faults it pays). Whether it was taken (not where slots release already)."""
    if not pool.slot_pages or not pool.size:
        return False
    pool.set_slot_pages(False)
    trim_heap()
    why = f"{mib(memory.held)} held, past the budget of {mib(memory.budget)}"
    memory.slot_pages, memory.slot_pages_why = "released", f"{why}: {pool.size} workers kept"
    memory.shed(f"slot pages: released once their batch is ({why})")
    return True


def predicted_peak(
    memory: LoaderMemory,
    pool: Any,
    workers: int,
    batch_bytes: float,
    here: float,
    kept: bool,
    in_flight: int | None = None,
) -> float:
    """What the loader will hold at its worst moment with ``workers`` workers, their slots keeping
    their pages (``kept``) or not, each with ``in_flight`` batches in flight (None: as many as
    now): each worker at the most one of the workers was read to hold
    alone, or a batch (its samples, which a reading between batches misses), or before any was
    read two (its first result travels in a segment of its own until its ring is sized), and
    every slot resident that may be (kept: each worker's batches in flight and the one the
    consumer holds; released: those in flight, and the consumer's one), the zygote as read, and
    ``here`` bytes in this process. A reading every :data:`CHECK_EVERY_S` misses what comes between; this does not."""
    zygote = pool.zygote_pid
    # unread: a batch's samples, and its result in a segment of its own until the ring is sized
    heap = max((n for pid, n in memory.alone.items() if pid != zygote), default=2 * batch_bytes)
    slot = slot_bytes(int(batch_bytes))
    now = max(pool.per_worker, pool.threads)
    in_flight = now if in_flight is None else max(in_flight, pool.threads)
    rings = workers * (in_flight + 1) * slot if kept else (workers * in_flight + 1) * slot
    if kept and workers >= pool.size and in_flight >= now:
        rings = max(rings, pool.ring_bytes)  # a ring with a slot more where the consumer held more
    held_by_zygote = memory.alone.get(zygote, 0.0) if zygote is not None else 0.0
    return here + held_by_zygote + workers * max(heap, batch_bytes) + rings


def hold_peak(
    memory: LoaderMemory, pool: Any, workers: int, batch_bytes: float, here: float
) -> bool:
    """Keep the predicted peak (:func:`predicted_peak`) of ``workers`` workers under the budget:
    their slots give their pages back where resident ones would not fit, and keep them again
    where they fit within :data:`ROOM_SHARE`. Whether it is past the budget even so (a worker
    must go). Called before workers are added, and at each reading; ``batch_bytes`` 0 (no batch
    measured yet): nothing to predict."""
    if batch_bytes <= 0 or workers < 1:
        return False
    kept = predicted_peak(memory, pool, workers, batch_bytes, here, kept=True)
    if pool.slot_pages and kept > memory.budget:
        pool.set_slot_pages(False)
        trim_heap()
        why = f"{mib(kept)} predicted at the peak with {workers} workers' slots resident"
        memory.slot_pages, memory.slot_pages_why = (
            "released",
            f"{why}, past the budget of {mib(memory.budget)}",
        )
        memory.shed(f"slot pages: released once their batch is ({why})")
    elif not pool.slot_pages and memory.settled and kept <= ROOM_SHARE * memory.budget:
        pool.set_slot_pages(True)
        memory.slot_pages = "kept"
        memory.slot_pages_why = (
            f"{mib(kept)} predicted at the peak with {workers} workers' slots resident is within "
            f"{ROOM_SHARE:.0%} of the budget of {mib(memory.budget)}"
        )
        memory.settle()
    return (
        pool.slot_pages is False
        and predicted_peak(memory, pool, workers, batch_bytes, here, False) > memory.budget
    )


def workers_fitting(
    memory: LoaderMemory,
    pool: Any,
    most: int,
    batch_bytes: float,
    here: float,
    in_flight: int | None = None,
) -> int:
    """The most workers, up to ``most`` and at least one, whose predicted peak with released slots
    and ``in_flight`` batches in flight each (None: as many as now; :func:`predicted_peak`) is
    within the budget: the cap a loader sets before it adds workers."""
    fits = (
        n
        for n in range(most, 1, -1)
        if predicted_peak(memory, pool, n, batch_bytes, here, False, in_flight) <= memory.budget
    )
    return next(fits, 1)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def over_budget(memory: LoaderMemory, workers: int) -> str:
    """The warning for a loader whose chosen ``num_workers`` hold more than its budget."""
    budget = (
        "its ram_budget"
        if memory.given
        else f"the default budget ({DEFAULT_SHARE:.0%} of the memory available)"
    )
    return (
        f"this DataLoader's {workers} worker processes and their rings hold {memory.held / 2**20:.0f} MiB of "
        f"their own, past {budget}: {memory.budget / 2**20:.0f} MiB. num_workers is yours and is kept; fewer "
        "workers or a smaller prefetch_factor hold less, and num_workers='auto' keeps to the budget by itself "
        "(docs/autotune.md)"
    )

"""What every iterator measures of itself, and the knobs the autotuner may turn.

Every iterator counts its elements and the wall time spent in its ``next`` (the base class does
it: two clock reads an element). Asynchronous iterators also record what only they can see: the
calls their threads or workers ran (:class:`~torchpipe.runtime.timing.CallTiming`), how long the
consumer waited on them, how full their buffer was and how large its elements are. The
autotuner reads these totals from another thread; a torn read of a float is harmless there.
"""

from __future__ import annotations

import math
import random
from typing import Any

from torchpipe.observe.tracing import Track
from torchpipe.runtime.sizes import element_bytes
from torchpipe.runtime.timing import CallTiming

_BYTES_EVERY = 16  # elements between two samples of an element's size
CLOCK_ALL_S = 20e-6  # elements that take this long are all clocked (two clock reads cost < 1%);
CLOCK_EVERY = 16  # cheaper ones with a chance of one in this many
_LOG_SKIP = math.log(1.0 - 1.0 / CLOCK_EVERY)
CLOCK_GAPS = random.Random(0x5EED)
"""Draws the gaps between clocked cheap elements (its own generator: the user's global RNGs are not touched)."""


class IteratorStats:
    """Counters every iterator keeps; cheap enough to stay on.

    Attributes:
        produced: elements returned by ``next``.
        wall_s: seconds spent in ``next`` (the input's ``next`` included when it runs there):
            its waits (``wait_s``, all counted) and the rest, an estimate where elements are
            cheap (see :meth:`clocked`).
        unclocked: elements to return before the next one is clocked.
        wait_s: of that, seconds blocked waiting for a buffer or a result (asynchronous ops).
        calls: the calls run on threads or workers (asynchronous ops that have a pool).
        blocked_output_s: seconds a producer thread waited for room in a full buffer.
        occupancy_sum, occupancy_n: the buffer's fill, summed over ``occupancy_n`` looks.
        capacity: the buffer's size at the last look.
        bytes_sum, bytes_n: tensor and array bytes of sampled elements.
        counters: op-specific counters (``errors_ignored``, ``inner_datasets``, ...).
    """

    __slots__ = (
        "produced",
        "_busy_s",
        "unclocked",
        "_weight",
        "wait_s",
        "calls",
        "blocked_output_s",
        "occupancy_sum",
        "occupancy_n",
        "capacity",
        "bytes_sum",
        "bytes_n",
        "counters",
        "trace",
        "clock_all_s",
    )

    def __init__(self) -> None:
        self.produced = 0
        self._busy_s = 0.0
        self.unclocked = 0
        self._weight = 1
        self.wait_s = 0.0
        self.calls: CallTiming | None = None
        self.blocked_output_s = 0.0
        self.occupancy_sum = 0
        self.occupancy_n = 0
        self.capacity = 0
        self.bytes_sum = 0
        self.bytes_n = 0
        self.counters: dict[str, int] = {}
        self.trace: Track | None = None  # the stage's track when the pass is traced
        self.clock_all_s = CLOCK_ALL_S  # a traced pass that records every element clocks every one

    @property
    def wall_s(self) -> float:
        return self._busy_s + self.wait_s

    def clocked(self, seconds: float, waited: float = 0.0) -> None:
        """Add one clocked element's time (``waited`` of it in ``wait_s`` already) to ``wall_s``,
        and choose the next element to clock.

        Two clock reads cost about 0.1 us, a few percent of an element that costs a few us. So
        after an element under ``CLOCK_ALL_S`` (waits aside), each element is clocked with a
        chance of one in ``CLOCK_EVERY`` (the gap is drawn at once, geometric) and counts
        ``CLOCK_EVERY`` times; after a slower one, the next is clocked. Each element's chance is
        fixed before it is measured, so the estimate is unbiased, and random gaps cannot fall in
        step with costs that repeat (a read every 16 records). Waits are counted for every
        element as they happen, so only the rest is scaled up: one long wait in a clocked cheap
        element would otherwise count 16 times, and land in the op's self time.
        """
        busy = seconds - waited
        self._busy_s += busy * self._weight
        if busy >= self.clock_all_s:
            self._weight = 1
        else:
            self._weight = CLOCK_EVERY
            self.unclocked = int(math.log(1.0 - CLOCK_GAPS.random()) / _LOG_SKIP)

    def clocked_together(self, t0: float, t1: float, waited: float = 0.0) -> None:
        """Add the time of elements clocked as one, from ``t0`` to ``t1`` (``perf_counter``
        times; ``waited`` of it in ``wait_s`` already): an op that hands over several at once
        measures all of them, so nothing is scaled up."""
        self._busy_s += t1 - t0 - waited
        if self.trace is not None:
            self.trace.span(t0, t1)

    def look(self, occupancy: int, capacity: int) -> None:
        """Record how full the buffer is as the consumer takes an element."""
        self.occupancy_sum += occupancy
        self.occupancy_n += 1
        self.capacity = capacity
        if self.trace is not None:
            self.trace.counter(occupancy)

    def sample_bytes(self, element: Any) -> bool:
        """Record the size of every 16th element (the first included); True if this one was."""
        if self.produced % _BYTES_EVERY:
            return False
        self.bytes_sum += element_bytes(element)
        self.bytes_n += 1
        return True

    @property
    def bytes_per_element(self) -> float:
        return self.bytes_sum / self.bytes_n if self.bytes_n else 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"produced": self.produced, "wall_s": self.wall_s}
        if self.calls is not None:
            calls, work_s, cpu_s = self.calls.totals()
            out.update(calls=calls, work_s=work_s, cpu_s=cpu_s)
            if self.calls.delay_s > 0:  # waited for a core (a busy machine)
                out["delay_s"] = self.calls.delay_s
        if self.occupancy_n:
            out.update(
                wait_s=self.wait_s,
                occupancy=self.occupancy_sum / self.occupancy_n,
                capacity=self.capacity,
            )
        if self.blocked_output_s:
            out["blocked_output_s"] = self.blocked_output_s
        if self.bytes_n:
            out["bytes_per_element"] = self.bytes_per_element
        out.update(self.counters)
        return out

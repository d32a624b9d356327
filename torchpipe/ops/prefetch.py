"""``prefetch``: elements computed ahead on a background thread into a bounded buffer.

A daemon thread pulls input elements through a :class:`~torchpipe.core.position_log.PositionLog` into a
:class:`PrefetchBuffer`; the consumer takes them in order. Upstream errors travel through the
buffer in their position and iteration continues after them. The checkpoint is the input's
position before the oldest element not yet delivered: buffered elements are recomputed after a
resume, never saved.

A thread pays only where there is something to overlap: handing an element from one Python
thread to another costs a few microseconds of GIL hand-offs, more than a cheap input takes to make
one, and a consumer that asks again at once (a benchmark loop, a loop that only counts) gives the
thread nothing to hide. So ``prefetch(tp.AUTOTUNE)`` (the one the optimizer puts at the end of
every pipeline, too) over an input in which no stage runs ahead (no parallel map or interleave)
starts inline, as the plain loop, and measures what the consumer gets, window by window: its
thread is tried where the consumer's own time between requests is long enough beside the input's
for an overlap to pay, and kept where it measured faster (:class:`OverlapChoice`); the other mode
is measured again when the consumer's own time per element changes. Over a stage that runs
ahead, and for an explicit ``prefetch(n)``, it keeps its thread.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from torchpipe.constants import AUTOTUNE
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import AUTOTUNE_SYMBOL, BuildContext, Node
from torchpipe.core.position_log import PositionLog
from torchpipe.core.stats import IteratorStats
from torchpipe.core.tunable import BUFFER, POOL, Tunable
from torchpipe.runtime.knob import LiveKnob
from torchpipe.runtime.placement.costs import INLINE, THREAD
from torchpipe.runtime.placement.driver import OVERLAP, MoveDriver, cost_changed
from torchpipe.runtime.placement.overlap import choose_overlap
from torchpipe.runtime.placement.policy import STALE_MAX_S, STALE_S

AUTOTUNE_DEPTH = 2
"""Buffer depth used for ``prefetch(tp.AUTOTUNE)`` until the autotuner resizes it."""
MAX_DEPTH = 64
"""The deepest buffer the autotuner gives a prefetch (the RAM budget may allow less)."""

_POLL_S = 0.1
_JOIN_S = 1.0


class PrefetchNode(Node):
    """The input's elements, computed up to ``buffer_size`` ahead on a background thread."""

    kind = "prefetch"
    checkpoints_as_input = True

    def __init__(self, input: Node, buffer_size: int) -> None:
        super().__init__(input)
        self.buffer_size = buffer_size

    def params(self) -> dict[str, Any]:
        return {
            "buffer_size": AUTOTUNE_SYMBOL if self.buffer_size == AUTOTUNE else self.buffer_size
        }

    def is_asynchronous(self) -> bool:
        return self.buffer_size != 0

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        if self.buffer_size == 0:
            return source
        if self.buffer_size == AUTOTUNE:
            learned = ctx.learned()  # the depth the tuner left in the last pass, if any
            return PrefetchIterator(
                self.kind,
                source,
                learned.get("depth", AUTOTUNE_DEPTH),
                tunable=True,
                learned=learned,
            )
        return PrefetchIterator(self.kind, source, self.buffer_size)


def _stages_below(source: Iterator) -> list[Tunable]:
    """The stages in ``source``'s chain that may compute ahead of their consumer (a parallel map
    or interleave, another prefetch)."""
    found: list[Tunable] = []
    pending = [source]
    while pending:
        it = pending.pop()
        if isinstance(it, Tunable):
            found.append(it)
        pending.extend(it.inputs)
    return found


def runs_ahead(stage: Tunable) -> bool:
    """Whether ``stage`` computes ahead of its consumer now: a buffer, or a pool of threads or
    processes (a parallel map whose calls the policy placed inline does not)."""
    return stage.tuning_role == BUFFER or (stage.tuning_role == POOL and stage.parallelism() > 0)


class _End:
    """Marks the end of the input in the buffer."""


class _Failure:
    """An error that ended the producer (not an element's error); delivered, then the end."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = _End()
DRAINED = object()
"""What the buffer gives once a paused producer has left it empty: the input is the consumer's now."""


class PrefetchBuffer:
    """The bounded hand-off between one producer thread and the consumer.

    ``depth`` is a plain attribute: changing it while the pipeline runs takes effect at the
    producer's next check (within a poll interval). Every wait is bounded and stops when
    :meth:`stop` is called.

    Args:
        depth: how many elements may wait in the buffer (at least 1 is always allowed).
    """

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.paused = False  # the producer stops after its element in hand (the input goes inline)
        self._producer_left = False  # it saw the pause and left

    def __len__(self) -> int:
        return len(self._items)

    @property
    def depth(self) -> int:
        return self._depth

    @depth.setter
    def depth(self, value: int) -> None:
        with self._cond:
            self._depth = value
            self._cond.notify_all()  # a producer waiting for room may have some now

    def wait_for_room(self) -> bool:
        """Block until fewer than ``depth`` items wait; False once stopped or paused."""
        with self._cond:
            while not self._stopped and not self.paused and len(self._items) >= max(1, self._depth):
                self._cond.wait(_POLL_S)
            if self.paused:
                self._producer_left = True
                self._cond.notify_all()  # a consumer waiting for an item takes the input inline now
            return not self._stopped and not self.paused

    def pause(self) -> None:
        """Let the producer finish its element in hand and leave."""
        with self._cond:
            self.paused = True
            self._cond.notify_all()

    def resume(self) -> bool:
        """Undo :meth:`pause`; False if the producer has left already (start another)."""
        with self._cond:
            self.paused = False
            left, self._producer_left = self._producer_left, False
            return not left

    def append(self, item: Any) -> None:
        """Add an item (dropped once stopped) and wake the consumer."""
        with self._cond:
            if not self._stopped:
                self._items.append(item)
                self._cond.notify_all()

    def take(self, producer_alive: Callable[[], bool], stage: str) -> Any:
        """The oldest item, waiting in bounded steps; ``DRAINED`` once a paused producer has left
        and nothing is left to take.

        Raises:
            RuntimeError: if the producer is gone and left nothing to take.
        """
        with self._cond:
            while not self._items:
                if self._stopped:
                    raise RuntimeError(f"{stage}: iterator is closed")
                if self._producer_left or (self.paused and not producer_alive()):
                    return DRAINED
                if not producer_alive():
                    raise RuntimeError(
                        f"{stage}: the prefetch thread ended without delivering the end of input"
                    )
                self._cond.wait(_POLL_S)
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def stop(self) -> None:
        """Release every waiter and drop the buffered items."""
        with self._cond:
            self._stopped = True
            self._items.clear()
            self._cond.notify_all()


class _PullClock:
    """The input's time per element, from the thread or from inline pulls (a plain average of the
    last window's; a torn read between the two fields only skews one window)."""

    __slots__ = ("count", "seconds")

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds

    def per_element(self) -> float:
        count, seconds = self.count, self.seconds
        self.count, self.seconds = 0, 0.0
        return seconds / count if count else 0.0


def _produce(
    log: PositionLog, buffer: PrefetchBuffer, stats: IteratorStats, clock: _PullClock
) -> None:
    """The producer thread's loop; it holds only the log, the buffer and the stats, never the iterator."""
    while True:
        t0 = time.perf_counter()
        room = buffer.wait_for_room()
        t1 = time.perf_counter()
        stats.blocked_output_s += t1 - t0
        if not room:
            return
        item = _pull(log)
        clock.add(time.perf_counter() - t1)
        buffer.append(item)
        if item is _END or isinstance(item, _Failure):
            return
        # not kept while waiting for room: the consumer may be done with it by then (a batch
        # that views a worker's ring record holds the record until its last reference goes)
        del item


def _pull(log: PositionLog) -> Any:
    """The next input item, ``_END`` at its end, or the ``_Failure`` that ended it."""
    try:
        return log.pull()
    except StopIteration:
        return _END
    except BaseException as e:  # noqa: BLE001 - delivered to the consumer, who raises it
        return _Failure(e)


class OverlapChoice:
    """Whether a ``prefetch(tp.AUTOTUNE)`` runs its input on its thread or inline, by measurement.

    The runtime's measure-and-move driver (:class:`~torchpipe.runtime.placement.driver.MoveDriver`, with
    the cadence :data:`~torchpipe.runtime.placement.driver.OVERLAP`) cuts the delivered elements into
    windows; each says what the consumer got per element, its own time between requests
    included: what the two modes are compared by (:func:`~torchpipe.runtime.placement.overlap.choose_overlap`).
    A consumer whose own time per element changes by ``CHANGED`` is measured afresh, and a
    measurement older than ``STALE_S`` no longer stands for its mode; each time the input leaves
    a mode it was measured in, that mode's measurement stands twice as long (up to
    ``STALE_MAX_S``), so a thread that keeps losing is tried less and less often.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._driver = MoveDriver(OVERLAP)
        self._measured: dict[str, tuple[float, float]] = {}  # mode -> (seconds per element, when)
        self._stale_s: dict[str, float] = {}  # mode -> how long its measurement stands
        self._consumer_s: float | None = None  # the consumer's own time per element when decided
        self._count = 0  # elements delivered, in every pass

    def new_pass(self) -> None:
        """Another pass starts where the last left the input: the windows go on (one may be a
        whole short epoch, judged at its end)."""
        self._driver.new_pass(self._count)

    def delivered(
        self,
        now: float,
        outside_s: float,
        pull_s: Callable[[], float],
        last: bool = False,
        may_inline: Callable[[], bool] | None = None,
    ) -> str:
        """After each delivered element (``last``: the end of the pass, after the last one):
        ``outside_s`` the consumer's time outside ``next()`` so far in this pass, ``pull_s()``
        the input's time per element since it was last asked; ``may_inline()``: whether the
        input may run inline now (asked while it does, and before a move to it). Returns the mode
        to run in from now on."""
        if self.mode == INLINE and may_inline is not None and not may_inline():
            self.mode = THREAD  # a stage below runs ahead now: the thread pulls from it again
            self._driver.moved(THREAD, self._count + OVERLAP.settle_elements, now)
            return self.mode
        self._count += 0 if last else 1
        count = self._count
        done = self._driver.window(now, count, lambda: (count, outside_s), last=last)
        if done is None:
            return self.mode
        (first, outside0), _, seconds = done
        elements = count - first
        per_element, consumer_s = seconds / elements, (outside_s - outside0) / elements
        self._measured[self.mode] = (per_element, now)
        verdict = self._verdict(now, per_element, consumer_s, pull_s())
        if verdict == INLINE and may_inline is not None and not may_inline():
            verdict = THREAD
        if verdict != self.mode and self._driver.agreed(verdict):
            self._stale_s[self.mode] = min(2 * self._stale_s.get(self.mode, STALE_S), STALE_MAX_S)
            self.mode = verdict
            self._driver.moved(verdict, count + OVERLAP.settle_elements, now)
            self._consumer_s = consumer_s
        return self.mode

    def _verdict(self, now: float, per_element: float, consumer_s: float, pull_s: float) -> str:
        base = self._consumer_s
        # Another consumer: the other mode's figure is old. A change small beside an element's
        # time is not one: a consumer sharing the GIL with the thread takes longer by as much.
        if cost_changed(consumer_s, base) and abs(consumer_s - (base or 0.0)) > per_element / 2:
            self._measured = {self.mode: (per_element, now)}
            self._stale_s.clear()
            self._consumer_s = consumer_s
        measured = {
            mode: s
            for mode, (s, when) in self._measured.items()
            if now - when < self._stale_s.get(mode, STALE_S)
        }
        return choose_overlap(
            self.mode, measured, pull_s, consumer_s, retry_thread=base is not None
        )


class PrefetchIterator(Iterator, Tunable):
    """Runs the input on a daemon thread, keeping up to ``depth`` elements ready.

    With ``tunable`` the input runs inline where that measures faster, while no stage below runs
    ahead of its consumer (:func:`runs_ahead`): such a stage is fed, and its results received,
    by whoever pulls from it, so the prefetch keeps its thread, which pulls while the consumer
    works (inline, the stage's own executor choice would measure another consumer).

    Args:
        name: the stage name.
        source: the input iterator (owned by the thread once started).
        depth: the buffer depth; see :attr:`depth`.
        tunable: the autotuner may change the depth (``prefetch(tp.AUTOTUNE)``).
        learned: where the depth the tuner sets is kept for the next pass.
    """

    tuning_role = BUFFER

    def __init__(
        self,
        name: str,
        source: Iterator,
        depth: int,
        tunable: bool = False,
        learned: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(name, source)
        self._learned = learned if learned is not None else {}
        self._log = PositionLog(source)
        self.buffer = PrefetchBuffer(depth)
        self._knob: LiveKnob | None = None
        self._choice: OverlapChoice | None = None
        if tunable:
            self._knob = LiveKnob(
                f"{name}.buffer_size", depth, 1, MAX_DEPTH, True, self._set_depth, immediate=True
            )
            # with its windows; inline first, as the plain loop, until a thread measures faster
            self._choice = self._learned.setdefault("choice", OverlapChoice(INLINE))
            self._choice.new_pass()
            self._below = _stages_below(source)
        count_held = getattr(source, "count_held_above", None)
        if count_held is not None:  # a parallel map: what waits here is part of its window
            count_held(self.buffer.__len__)
        self._thread: threading.Thread | None = None
        self._pulls = _PullClock()
        self._delivered = 0
        self._outside_s = 0.0  # the consumer's time between its requests, in all
        self._returned: float | None = None
        self._direct = False  # inline, with nothing left from the thread: the input is pulled here
        self._done = False
        # An abandoned iterator must not leave its thread running.
        self._finalizer = weakref.finalize(self, self.buffer.stop)

    @property
    def depth(self) -> int:
        """The buffer depth; may be changed while running (the autotuner does)."""
        return self.buffer.depth

    @depth.setter
    def depth(self, value: int) -> None:
        self.buffer.depth = int(value)

    def knobs(self) -> list[LiveKnob]:
        return [self._knob] if self._knob is not None else []

    def buffer_slots(self) -> int:
        return self.buffer.depth

    def parallelism(self) -> int:
        return 1  # one thread of this process fills the buffer

    def calls_in_processes(self) -> bool:
        return False

    def executor_report(self) -> dict[str, Any]:
        """Where the input runs, for ``it.stats()``: ``executor`` is ``thread`` or ``inline``."""
        return {"executor": self.mode}

    def _set_depth(self, value: int) -> None:
        self.buffer.depth = value
        self._learned["depth"] = value

    @property
    def mode(self) -> str:
        """``thread`` or ``inline``: where the input runs (``prefetch(tp.AUTOTUNE)`` chooses)."""
        return self._choice.mode if self._choice is not None else THREAD

    def leave_in(self, mode: str) -> None:
        """A seam for tests: take ``mode`` (``inline`` or ``thread``) as where this pass leaves its
        input, as a window's verdict would, for the next pass over the Dataset to start from.

        Raises:
            ValueError: for another mode, or a depth that is not AUTOTUNE (no choice to make).
        """
        if self._choice is None:
            raise ValueError(
                "the prefetch is not prefetch(tp.AUTOTUNE): it always runs its input on its thread"
            )
        if mode not in (INLINE, THREAD):
            raise ValueError(f"a prefetch's input runs 'inline' or on a 'thread', not {mode!r}")
        self._choice.mode = mode

    def start(self) -> None:
        # Pin the starting position on this thread, before the producer owns the input.
        self._log.state()
        if self.mode == THREAD:
            self._start_thread()
        else:
            self.buffer.pause()

    def _start_thread(self) -> None:
        args = (self._log, self.buffer, self.stats, self._pulls)
        self._thread = threading.Thread(
            target=_produce, args=args, name=f"torchpipe-{self.name}", daemon=True
        )
        self._thread.start()

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        now = time.perf_counter()
        if self._returned is not None:
            self._outside_s += now - self._returned
        try:
            if not self._direct:
                item = self._take()
                if item is not DRAINED:
                    return self._deliver(item)
                self._direct = True  # the thread has left and all it made is delivered
            return self._pull_here(now)
        finally:
            self._returned = time.perf_counter()
            if self._choice is not None:
                self._review()

    def _take(self) -> Any:
        thread, buffer = self._thread, self.buffer
        t0 = time.perf_counter()
        self.stats.look(len(buffer), buffer.depth)
        item = buffer.take(lambda: thread is not None and thread.is_alive(), self.name)
        self.stats.wait_s += time.perf_counter() - t0
        return item

    def _pull_here(self, now: float) -> Any:
        """The next element straight from the input, on the consumer's thread: no log, no buffer."""
        try:
            element = next(self.inputs[0])
        except StopIteration:
            self._done = True
            raise
        finally:
            self._pulls.add(time.perf_counter() - now)
        self._delivered += 1
        return element

    def _deliver(self, item: Any) -> Any:
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        seq, element, error = item
        self._log.delivered(seq)
        self._delivered += 1
        if error is not None:
            raise error
        self.stats.sample_bytes(element)
        return element

    def _nothing_ahead(self) -> bool:
        """Whether no stage below runs ahead of its consumer now (the input may then run inline)."""
        return not any(runs_ahead(stage) for stage in self._below)

    def _review(self) -> None:
        # after an element, when choosing
        assert self._choice is not None and self._returned is not None
        mode = self._choice.mode
        verdict = self._choice.delivered(
            self._returned,
            self._outside_s,
            self._pulls.per_element,
            self._done,
            self._nothing_ahead,
        )
        # at the end of a pass: the next one starts in the new mode
        if verdict == mode or self._done:
            return
        if verdict == INLINE:
            self.buffer.pause()  # what the thread has made is delivered first, then the input comes here
            return
        if self._direct:
            self._direct = False
            self._log.rebase()  # the input moved on outside the log
        # a pass that started inline has none yet
        if not self.buffer.resume() or self._thread is None:
            self._start_thread()

    def get_state(self) -> dict[str, Any]:
        # The input's own state at the consumer's position: elements read ahead are read
        # again after a resume. So a prefetch adds nothing to a checkpoint, and one with and
        # one without it (the optimizer injects one) load each other's.
        if self._direct:
            return copy.deepcopy(self.inputs[0].state_dict())
        return copy.deepcopy(self._log.state()["input"])

    def set_state(self, state: dict[str, Any]) -> None:
        self._log.set_state({"input": state, "seq": 0, "skip": []})

    def shutdown(self) -> None:
        self._finalizer()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)

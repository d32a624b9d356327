"""``prefetch``: elements computed ahead on a background thread into a bounded buffer.

A daemon thread pulls input elements through a :class:`~torchpipe.ops.base.PositionLog` into a
:class:`PrefetchBuffer`; the consumer takes them in order. Upstream errors travel through the
buffer in their position and iteration continues after them. The checkpoint is the input's
position before the oldest element not yet delivered: buffered elements are recomputed after a
resume, never saved.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from torchpipe.constants import AUTOTUNE
from torchpipe.ops.base import AUTOTUNE_SYMBOL, BuildContext, Iterator, Node, PositionLog
from torchpipe.ops.stats import IteratorStats, LiveKnob

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
        return {"buffer_size": AUTOTUNE_SYMBOL if self.buffer_size == AUTOTUNE else self.buffer_size}

    def is_asynchronous(self) -> bool:
        return self.buffer_size != 0

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        if self.buffer_size == 0:
            return source
        if self.buffer_size == AUTOTUNE:
            learned = ctx.learned()  # the depth the tuner left in the last pass, if any
            return PrefetchIterator(self.kind, source, learned.get("depth", AUTOTUNE_DEPTH), tunable=True,
                                    learned=learned)  # fmt: skip
        return PrefetchIterator(self.kind, source, self.buffer_size)


class _End:
    """Marks the end of the input in the buffer."""


class _Failure:
    """An error that ended the producer (not an element's error); delivered, then the end."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = _End()


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
        """Block until fewer than ``depth`` items wait; False once stopped."""
        with self._cond:
            while not self._stopped and len(self._items) >= max(1, self._depth):
                self._cond.wait(_POLL_S)
            return not self._stopped

    def append(self, item: Any) -> None:
        """Add an item (dropped once stopped) and wake the consumer."""
        with self._cond:
            if not self._stopped:
                self._items.append(item)
                self._cond.notify_all()

    def take(self, producer_alive: Callable[[], bool], stage: str) -> Any:
        """The oldest item, waiting in bounded steps.

        Raises:
            RuntimeError: if the producer is gone and left nothing to take.
        """
        with self._cond:
            while not self._items:
                if self._stopped:
                    raise RuntimeError(f"{stage}: iterator is closed")
                if not producer_alive():
                    raise RuntimeError(f"{stage}: the prefetch thread ended without delivering the end of input")
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


def _produce(log: PositionLog, buffer: PrefetchBuffer, stats: IteratorStats) -> None:
    """The producer thread's loop; it holds only the log, the buffer and the stats, never the iterator."""
    while True:
        t0 = time.perf_counter()
        room = buffer.wait_for_room()
        stats.blocked_output_s += time.perf_counter() - t0
        if not room:
            return
        try:
            item: Any = log.pull()
        except StopIteration:
            buffer.append(_END)
            return
        except BaseException as e:  # noqa: BLE001 - delivered to the consumer, who raises it
            buffer.append(_Failure(e))
            return
        buffer.append(item)


class PrefetchIterator(Iterator):
    """Runs the input on a daemon thread, keeping up to ``depth`` elements ready.

    Args:
        name: the stage name.
        source: the input iterator (owned by the thread once started).
        depth: the buffer depth; see :attr:`depth`.
        tunable: the autotuner may change the depth (``prefetch(tp.AUTOTUNE)``).
        learned: where the depth the tuner sets is kept for the next pass.
    """

    tuning_role = "buffer"

    def __init__(self, name: str, source: Iterator, depth: int, tunable: bool = False,
                 learned: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(name, source)
        self._learned = learned if learned is not None else {}
        self._log = PositionLog(source)
        self.buffer = PrefetchBuffer(depth)
        self._knob: LiveKnob | None = None
        if tunable:
            self._knob = LiveKnob(f"{name}.buffer_size", depth, 1, MAX_DEPTH, True, self._set_depth, immediate=True)
        self._thread: threading.Thread | None = None
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

    def _set_depth(self, value: int) -> None:
        self.buffer.depth = value
        self._learned["depth"] = value

    def start(self) -> None:
        # Pin the starting position on this thread, before the producer owns the input.
        self._log.state()
        self._thread = threading.Thread(
            target=_produce, args=(self._log, self.buffer, self.stats), name=f"torchpipe-{self.name}", daemon=True
        )
        self._thread.start()

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        thread, buffer = self._thread, self.buffer
        t0 = time.perf_counter()
        self.stats.look(len(buffer), buffer.depth)
        item = buffer.take(thread.is_alive, self.name)
        self.stats.wait_s += time.perf_counter() - t0
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        seq, element, error = item
        self._log.delivered(seq)
        if error is not None:
            raise error
        self.stats.sample_bytes(element)
        return element

    def get_state(self) -> dict[str, Any]:
        # The input's own state at the consumer's position: elements read ahead are read
        # again after a resume. So a prefetch adds nothing to a checkpoint, and one with and
        # one without it (the optimizer injects one) load each other's.
        return copy.deepcopy(self._log.state()["input"])

    def set_state(self, state: dict[str, Any]) -> None:
        self._log.set_state({"input": state, "seq": 0, "skip": []})

    def shutdown(self) -> None:
        self._finalizer()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)

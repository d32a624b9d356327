"""The readers of an interleave: what its state machine asks of them, and the inline pool.

An interleave (``interleave.py``) decides which inner dataset the next element comes from; a
**reader pool** reads them. The interleave opens a reader for each input element (at a saved
position, or going on from another pool's reader with what it read ahead), asks whether a reader
has an item ready, takes items, and closes readers it is done with. An item is one of four kinds:
an element (``VALUE``), an element's error (``ERROR``: the reader goes on), the end of the inner
dataset (``END``) or a failure to open it (``FAILED``: the user function or the input raised).

Three pools implement :class:`ReaderPool`: :class:`InlineReaders` (here: reads on demand, on the
consumer's thread), :class:`~torchpipe.ops.interleave.thread_readers.ThreadReaders` (read ahead on a thread
pool) and :class:`~torchpipe.ops.interleave.process_readers.ProcessReaders` (read ahead in worker processes,
chunk by chunk). A pool can let go of its readers (:meth:`ReaderPool.release`) as
:class:`ReaderPlace` records that another pool opens again, which is how ``executor="auto"``
moves readers between threads and processes.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext
from torchpipe.core.stats import IteratorStats
from torchpipe.runtime.placement.costs import INLINE

VALUE, ERROR, END, FAILED = "value", "error", "end", "failed"
"""What taking from a reader can give (see the module docstring)."""

MAX_PARALLELISM = 64
"""The most reads in flight the autotuner asks for in a parallel interleave."""

_READER_BYTES = 4 << 20  # what one reader may hold read ahead (AUTOTUNE, reading far ahead),
_MAX_READ_AHEAD = 4096  # and at most this many elements

Item = tuple[str, Any, Any]
"""``(kind, payload, inner state after it)``: an item read and not yet taken (the state is None
after ``END`` and ``FAILED``)."""


CHUNK_START, ITEMS_AFTER = "chunk_start", "items_after"
"""The keys of a position within a chunk: an inner state and the items read after it."""


def items_after(state: dict[str, Any] | None, count: int) -> dict[str, Any]:
    """The inner position ``count`` items after ``state`` (itself a state or such a position).

    Readers take the inner iterator's ``state_dict()`` once a chunk of items, not once an item;
    an item within a chunk stands at its chunk's state and the items read since. Opening there
    (:class:`InnerOpener`) loads the state and reads past the items again: at most a chunk."""
    if is_items_after(state):
        assert state is not None  # a position is a dict
        return {CHUNK_START: state[CHUNK_START], ITEMS_AFTER: state[ITEMS_AFTER] + count}
    return {CHUNK_START: state, ITEMS_AFTER: count}


def is_items_after(state: Any) -> bool:
    """Whether ``state`` is a position :func:`items_after` made, not an inner iterator's state."""
    return (
        isinstance(state, dict)
        and len(state) == 2
        and CHUNK_START in state
        and ITEMS_AFTER in state
    )


def read_ahead_items(bytes_per_element: float) -> int:
    """Elements one reader may hold read ahead when reading far ahead: 4 MB of them, at most 4096."""
    return min(_READER_BYTES // max(int(bytes_per_element), 1), _MAX_READ_AHEAD)


class InnerOpener:
    """Builds the iterator of the dataset that the user function makes from one input element.

    Holds no reference to the interleave iterator, so pool threads can call it freely, and worker
    processes inherit it through fork.

    Args:
        fn: the user function, wrapped for this stage.
        ctx: the interleave's build context; inner dataset ``seq`` is built in ``ctx.inner(seq)``.
    """

    __slots__ = ("_fn", "_ctx")

    def __init__(self, fn: UserFunction, ctx: BuildContext) -> None:
        self._fn = fn
        self._ctx = ctx

    def seed_worker(self, slot: int) -> None:
        """See :meth:`UserFunction.seed_worker`."""
        self._fn.seed_worker(slot)

    def __call__(self, element: Any, seq: int, state: dict[str, Any] | None) -> Iterator:
        """The inner iterator of input element ``seq``, resumed at ``state`` if given (an inner
        iterator's state, or a position :func:`items_after` one).

        Raises:
            TypeError: if the function did not return a ``tp.Dataset``.
        """
        dataset = self._fn.on_element(seq, element)
        if not hasattr(dataset, "_node"):
            raise TypeError(
                f"{self._fn.stage}: the function must return a tp.Dataset, got {type(dataset).__name__} "
                f"(input element {seq})"
            )
        iterator = dataset._node.build(self._ctx.inner(seq))
        skip = 0
        if is_items_after(state):
            assert state is not None  # a position is a dict
            state, skip = state[CHUNK_START], state[ITEMS_AFTER]
        if state is not None:
            iterator.load_state_dict(state)
        for _ in range(skip):  # the items of its chunk taken before the checkpoint, read again
            try:
                next(iterator)
            except StopIteration:
                break
            except Exception:  # noqa: BLE001 - an element's error, delivered in its place before
                continue
        return iterator


class ReaderPlace(NamedTuple):
    """Where a reader stands: what :meth:`ReaderPool.release` gives, for another pool to
    ``open(*place)`` there.

    Attributes:
        element: the input element its inner dataset is made from.
        seq: that element's sequence number.
        inner: the inner iterator's state after the items the consumer took (None: the start).
        error: the input's error for this element: the reader only fails with it.
        read_ahead: items read after ``inner`` and not yet taken, in order.
    """

    element: Any
    seq: int
    inner: dict[str, Any] | None = None
    error: BaseException | None = None
    read_ahead: tuple[Item, ...] = ()


def read_on_from(
    inner: dict[str, Any] | None, read_ahead: tuple[Item, ...]
) -> dict[str, Any] | None:
    """The inner state where reading goes on: after the last item read ahead, else ``inner``."""
    states = [state for kind, _, state in read_ahead if kind in (VALUE, ERROR)]
    return states[-1] if states else inner


class Reader:
    """One open inner dataset, as the interleave sees it; each pool adds what it needs."""

    __slots__ = ("element", "seq", "error")

    def __init__(self, element: Any, seq: int, error: BaseException | None) -> None:
        self.element = element
        self.seq = seq
        self.error = error


ReaderT = TypeVar("ReaderT", bound=Reader)
"""The reader a pool makes (each pool's reader class adds what that pool needs)."""


class ReaderPool(abc.ABC, Generic[ReaderT]):
    """Where an interleave's readers read. One interleave may hold several (``executor="auto"``)
    and move its readers between them; all add to the stage's one set of counters.

    A pool that reads ahead keeps ``parallelism`` reads in flight; each reader holds a few items
    ready (:meth:`set_read_ahead` lets it hold more). ``start``/``park`` may alternate while the
    readers come and go; ``shutdown`` is final.
    """

    kind: ClassVar[str]
    """The executor it stands for in the policy: ``inline``, ``thread`` or ``process``."""

    stats: IteratorStats  # set by bind(), before the pool reads

    def bind(self, stats: IteratorStats) -> None:
        """Count waits, buffer looks and reads' costs (``stats.calls``) in the stage's ``stats``."""
        self.stats = stats

    def prepare(self) -> None:
        """Fork what must be forked before the pipeline starts threads (a process pool's zygote)."""

    def start(self, parallelism: int) -> None:
        """Start reading, with ``parallelism`` reads in flight."""

    def resize(self, parallelism: int) -> None:
        """Keep ``parallelism`` reads in flight from now on."""

    def set_read_ahead(self, items: int) -> None:
        """Let each reader hold ``items`` read ahead (0: its usual few)."""

    def reader_capacity(self) -> int:
        """Items one reader may hold ready or in flight."""
        return 1

    def report(self) -> dict[str, Any]:
        """What ``it.stats()`` shows of it: its ``workers`` (threads or processes) and what else
        it has (the processes' ``pids``); nothing for inline reads."""
        return {}

    @property
    def calls_in_processes(self) -> bool:
        """Whether reads run in worker processes (their CPU is not this process's)."""
        return False

    @abc.abstractmethod
    def open(
        self,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None = None,
        error: BaseException | None = None,
        read_ahead: tuple[Item, ...] = (),
    ) -> ReaderT:
        """A reader of inner dataset ``seq``, made from input ``element``, at inner state ``inner``
        (None: its start), that gives ``read_ahead`` (items another pool read after ``inner``)
        first and reads on after them; or, with ``error`` (the input raised), one that only fails
        with it. It reads nothing until :meth:`read`. A released reader opens at ``open(*place)``.
        """

    def read(self, reader: ReaderT) -> None:
        """Have ``reader`` read ahead; it asks again by itself as it is taken from."""

    @abc.abstractmethod
    def has_ready(self, reader: ReaderT) -> bool:
        """Whether ``reader`` has an item to take without waiting."""

    @abc.abstractmethod
    def take(self, reader: ReaderT) -> tuple[str, Any]:
        """``reader``'s next ``(kind, payload)``, waiting in bounded steps for it.

        Raises:
            StallError: when a read has run longer than the stage's stall limit.
        """

    def wait(self, until: Callable[[], bool]) -> None:
        """Wait one bounded step for an item to be ready unless ``until()`` holds already.

        Raises:
            StallError: when a read has run longer than the stage's stall limit.
        """

    @abc.abstractmethod
    def inner_state(self, reader: ReaderT) -> dict[str, Any] | None:
        """The inner iterator's state after the items taken (None: its start)."""

    def place(self, reader: ReaderT) -> ReaderPlace:
        """Where ``reader`` stands as far as the consumer knows (what it read ahead aside)."""
        return ReaderPlace(reader.element, reader.seq, self.inner_state(reader), reader.error)

    @abc.abstractmethod
    def close(self, reader: ReaderT) -> None:
        """Stop ``reader`` and release its inner iterator."""

    @abc.abstractmethod
    def release(self, readers: list[ReaderT], others_stay: bool = False) -> list[ReaderPlace]:
        """Stop ``readers`` and close them, returning their places with what they read ahead,
        so that another pool goes on from there: nothing lost, repeated or read twice. A reader
        whose read in progress outlasts a short wait hands over nothing read ahead (its successor
        reads again from the items taken) rather than hold the move up. ``others_stay``: the
        pool's other readers stay and read on (only these stop)."""

    def accepts(self, places: list[ReaderPlace], element: Any) -> bool:
        """Whether readers at ``places`` can read here, giving elements like ``element``."""
        return True

    def children(self, readers: list[ReaderT]) -> list[Iterator]:
        """The inner iterators of ``readers`` that run on the consumer's thread (its stats show them)."""
        return []

    def park(self) -> None:
        """Stop reading (the readers were released or the pass ended); :meth:`start` goes on."""

    def shutdown(self) -> None:
        """Stop every thread and process of the pool; final."""


class _InlineReader(Reader):
    __slots__ = ("carried", "taken_state", "iterator")

    def __init__(
        self,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None,
        error: BaseException | None,
        read_ahead: tuple[Item, ...],
    ) -> None:
        super().__init__(element, seq, error)
        self.carried: deque[Item] | None = deque(read_ahead) if read_ahead else None
        self.taken_state = inner
        self.iterator: Iterator | None = None


class InlineReaders(ReaderPool[_InlineReader]):
    """Reads on demand, on the consumer's thread: one element when the interleave takes one.

    An inner dataset is opened when its first element is taken; its state is asked of its
    iterator only when a checkpoint wants it.

    Args:
        opener: builds an inner iterator from an input element.
    """

    kind = INLINE

    def __init__(self, opener: InnerOpener) -> None:
        self._opener = opener

    def open(
        self,
        element: Any,
        seq: int,
        inner: dict[str, Any] | None = None,
        error: BaseException | None = None,
        read_ahead: tuple[Item, ...] = (),
    ) -> _InlineReader:
        return _InlineReader(element, seq, inner, error, read_ahead)

    def has_ready(self, reader: _InlineReader) -> bool:
        return True  # reading it now is what ready means here

    def take(self, reader: _InlineReader) -> tuple[str, Any]:
        iterator = reader.iterator
        if iterator is None:
            if reader.carried or reader.error is not None:
                return self._carried(reader)
            try:
                iterator = reader.iterator = self._opener(
                    reader.element, reader.seq, reader.taken_state
                )
            except Exception as e:  # noqa: BLE001 - the reader fails with it, in its place
                return FAILED, e
        try:
            return VALUE, next(iterator)
        except StopIteration:
            return END, None
        except Exception as e:  # noqa: BLE001 - this element's error, delivered in its place
            return ERROR, e

    def _carried(self, reader: _InlineReader) -> tuple[str, Any]:
        """The next item read ahead by another pool, or the input's error."""
        if reader.error is not None:
            return FAILED, reader.error
        assert reader.carried is not None  # the error, or items read ahead (above)
        kind, payload, state = reader.carried.popleft()
        if kind in (VALUE, ERROR):
            reader.taken_state = state  # the inner dataset opens there once these are taken
        return kind, payload

    def inner_state(self, reader: _InlineReader) -> dict[str, Any] | None:
        return reader.iterator.state_dict() if reader.iterator is not None else reader.taken_state

    def close(self, reader: _InlineReader) -> None:
        if reader.iterator is not None:
            reader.iterator.close()

    def release(self, readers: list[_InlineReader], others_stay: bool = False) -> list[ReaderPlace]:
        places = []
        for reader in readers:
            carried = tuple(reader.carried or ())
            places.append(self.place(reader)._replace(read_ahead=carried))
            self.close(reader)
        return places

    def children(self, readers: list[_InlineReader]) -> list[Iterator]:
        return [reader.iterator for reader in readers if reader.iterator is not None]

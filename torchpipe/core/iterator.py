"""The physical half of an op: :class:`Iterator`, one pass's state."""

from __future__ import annotations

import abc
import time
from typing import Any

from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.core.stats import IteratorStats
from torchpipe.core.tunable import Tunable
from torchpipe.errors import CheckpointError

_NEW, _RUNNING, _CLOSED = range(3)


class Iterator(abc.ABC):
    """The physical, stateful iterator of one op.

    Subclasses implement :meth:`next` (raise ``StopIteration`` at the end), :meth:`get_state`
    and :meth:`set_state`, and override the hooks where the defaults do not fit: :meth:`start`
    (called once, before the first element), :meth:`shutdown` (release threads and buffers),
    :meth:`children`, :meth:`skip` (sources that seek) and :meth:`prepare` (ops that fork). An
    iterator the autotuner models also subclasses :class:`~torchpipe.core.tunable.Tunable`.

    Args:
        name: the stage name used in errors and stats, e.g. ``map(decode)``.
        inputs: the input iterators this one owns.
    """

    _status = _NEW  # class default, so a subclass that skipped __init__ gets a clear error

    # -- what an op implements ------------------------------------------------------------
    @abc.abstractmethod
    def next(self) -> Any:
        """The next element; raises StopIteration at the end."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """A fresh (unaliased) dict from which :meth:`set_state` can resume."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`get_state`'s output; called before the first element only."""

    # -- what an op may override (the defaults fit most ops) -------------------------------
    def skip(self) -> None:
        """Move past the next element without handing it over (StopIteration at the end).

        Sources that can seek override it to skip without reading (``shard`` uses it)."""
        next(self)

    def start(self) -> None:
        """Start background work; called once, just before the first element is asked for."""

    def prepare(self) -> None:
        """Fork worker processes' zygotes; runs right after the tree is built, before any thread.

        Overrides must call ``super().prepare()`` so the inputs are prepared too.
        """
        for child in self.children():
            child.prepare()

    def shutdown(self) -> None:
        """Stop background work and drop buffers; called once by :meth:`close`."""

    def children(self) -> list[Iterator]:
        """The iterators this one currently owns (closed with it, reported in stats)."""
        return self.inputs

    # -- what the base class does -----------------------------------------------------------
    def __init__(self, name: str, *inputs: Iterator) -> None:
        self.name = name
        self.inputs: list[Iterator] = list(inputs)
        self.stats = IteratorStats()
        self._status = _NEW

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        if self._status != _RUNNING:
            self._begin()
        stats = self.stats
        if stats.unclocked:  # cheap elements are clocked one in a few (see IteratorStats.clocked)
            stats.unclocked -= 1
            element = self.next()
            stats.produced += 1
            return element
        t0, waited = time.perf_counter(), stats.wait_s
        element = self.next()
        stats.produced += 1
        t1 = time.perf_counter()
        stats.clocked(t1 - t0, stats.wait_s - waited)
        if stats.trace is not None:  # a traced pass records the elements it clocks
            stats.trace.span(t0, t1)
        return element

    def take(self, count: int) -> list[Any]:
        """Up to ``count`` elements, fewer at the end of the input: what ``count`` calls of
        ``next()`` give (a source may give them at once); raises StopIteration with none left."""
        elements: list[Any] = []
        for _ in range(count):
            try:
                elements.append(next(self))
            except StopIteration:
                break
        if not elements:
            raise StopIteration
        return elements

    @property
    def running(self) -> bool:
        """Whether the first element was asked for (the iterator started) and it is not closed."""
        return self._status == _RUNNING

    def _begin(self) -> None:
        if self._status == _CLOSED:
            raise RuntimeError(f"{self.name}: iterator is closed")
        if not hasattr(self, "stats"):
            raise RuntimeError(f"{type(self).__name__}.__init__ did not call super().__init__()")
        self._status = _RUNNING
        self.start()

    def state_dict(self) -> dict[str, Any]:
        """This iterator's checkpoint: small, picklable, and unaliased with live state."""
        return self.get_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; only valid before the first element.

        Raises:
            RuntimeError: if the iterator already started.
            CheckpointError: if ``state`` is not a state of this op.
        """
        if self._status != _NEW:
            raise RuntimeError(f"{self.name}: load_state_dict() must come before the first element")
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.name}: expected a state dict, got {type(state).__name__}")
        try:
            self.set_state(state)
        except CheckpointError:
            raise
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{self.name}: malformed state ({e!r})") from e

    def close(self) -> None:
        """Stop background work and release resources; idempotent."""
        if self._status == _CLOSED:
            return
        self._status = _CLOSED
        try:
            self.shutdown()
        finally:
            for child in self.children():
                child.close()

    def all_stats(self) -> list[dict[str, Any]]:
        """Stats of this iterator and every iterator below it, root first."""
        out = [{"stage": self.name, **self.stats.as_dict()}]
        knobs = self.knobs() if isinstance(self, Tunable) else []
        if knobs:
            out[0]["knobs"] = {knob.name: knob.value for knob in knobs}
        for child in self.children():
            out.extend(child.all_stats())
        return out


class PassThroughIterator(Iterator):
    """Base of single-input ops whose state is the input's plus a few counters.

    ``COUNTERS`` names the counters; each lives in the attribute ``_<name>``.
    """

    INPUT = "input"
    COUNTERS: tuple[str, ...] = ()
    COUNTER_MINIMUM: int | None = 0
    """The least value an int counter may be loaded with (None: any)."""

    def __init__(self, name: str, source: Iterator) -> None:
        super().__init__(name, source)
        self._source = source

    def get_state(self) -> dict[str, Any]:
        state = {self.INPUT: self._source.state_dict()}
        state.update((key, getattr(self, "_" + key)) for key in self.COUNTERS)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, *self.COUNTERS)
        values = {key: self._checked_counter(state, key) for key in self.COUNTERS}
        self._source.load_state_dict(state[self.INPUT])
        for key, value in values.items():
            setattr(self, "_" + key, value)

    def _checked_counter(self, state: dict[str, Any], key: str) -> Any:
        """``state[key]``, which must have the type its counter started with (an int or a bool)."""
        current = getattr(self, "_" + key)
        if isinstance(current, bool):
            return check_bool(self.name, state, key)
        if isinstance(current, int):
            return check_int(self.name, state, key, minimum=self.COUNTER_MINIMUM)
        return state[key]

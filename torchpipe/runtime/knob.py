"""A knob the autotuner turns while a pipeline runs: a stage's parallelism or a buffer's depth."""

from __future__ import annotations

import threading
from collections.abc import Callable


class LiveKnob:
    """A value the autotuner may change while the pipeline runs: a parallelism or a buffer depth.

    The tuner thread calls :meth:`request`; the iterator that owns the knob applies the value on
    its own thread (:meth:`take_request`), where resizing a pool or a buffer is safe.

    Args:
        name: unique in the pipeline, e.g. ``map(decode).parallelism``.
        value: the current value.
        minimum, maximum: the range the tuner searches.
        is_buffer: a buffer depth (searched in powers of two) rather than a parallelism.
        apply: sets the value; called by the owner, or at once when ``immediate``.
        immediate: ``apply`` is safe from any thread.
    """

    def __init__(
        self,
        name: str,
        value: int,
        minimum: int,
        maximum: int,
        is_buffer: bool,
        apply: Callable[[int], None],
        immediate: bool = False,
    ) -> None:
        self.name = name
        self._value = value
        self.minimum = minimum
        self.maximum = max(minimum, maximum)
        self.is_buffer = is_buffer
        self._apply = apply
        self._immediate = immediate
        self._pending: int | None = None
        self._lock = threading.Lock()
        self.moves = 0  # times its owner moved the calls to another executor (:meth:`moved`)
        # a traced pass's counter of knob values
        self.trace: Callable[[str, float], None] | None = None

    @property
    def value(self) -> int:
        """The current value."""
        return self._value

    @value.setter
    def value(self, value: int) -> None:
        changed = value != self._value
        self._value = value
        # a traced pass sees every change, the tuner's or a move's
        if changed and self.trace is not None:
            self.trace(self.name, value)

    def moved(self, value: int) -> None:
        """The owner moved its calls (to another executor, or to more or fewer workers, the
        tuner's request included) and runs them on ``value`` workers now: a window with a move
        in it measured two placements."""
        self.value = value
        self.moves += 1

    def rebind(self, apply: Callable[[int], None]) -> None:
        """Have ``apply`` set the value from now on (a new owner took the knob over)."""
        self._apply = apply

    def request(self, value: int) -> None:
        """Ask for ``value`` (clamped to the range)."""
        value = max(self.minimum, min(self.maximum, int(value)))
        if self._immediate:
            with self._lock:
                self._apply(value)
                self.value = value
            return
        self._pending = value

    def take_request(self) -> None:
        """Apply a pending request; the owner calls this on its own thread (cheap when none)."""
        value = self._pending
        if value is None:
            return
        self._pending = None
        if value != self.value:
            self._apply(value)
            self.value = value

    def __repr__(self) -> str:
        return f"LiveKnob({self.name}={self.value} in [{self.minimum}, {self.maximum}])"

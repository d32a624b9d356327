"""What an asynchronous op took from its input and handed on: :class:`PositionLog`."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from torchpipe.core.iterator import Iterator
from torchpipe.core.state import check_int, check_state, is_int
from torchpipe.errors import CheckpointError


class PositionLog:
    """Input positions of the elements an asynchronous op has pulled but not yet delivered.

    Asynchronous ops (prefetch, parallel map, parallel interleave) run ahead of their
    consumer. Their checkpoint is the input's state just before the oldest undelivered element,
    plus the sequence numbers already delivered after it (non-deterministic order); in-flight
    elements are recomputed after a resume rather than saved. ``pull`` may run on a producer
    thread; everything else runs on the consumer's.

    Args:
        source: the input iterator; only ``pull`` touches it once started.
    """

    def __init__(self, source: Iterator) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._before: dict[int, dict[str, Any]] = {}
        self._order: deque[int] = deque()
        self._delivered_ahead: set[int] = set()
        self._skip: set[int] = set()
        self._next_seq = 0
        self._latest: dict[str, Any] | None = None

    def pull(self) -> tuple[int, Any, BaseException | None]:
        """Pull the next input element: ``(seq, element, error)``.

        A user error raised by the input is returned, not raised, so that it takes its place
        in the order. ``StopIteration`` propagates.
        """
        if self._latest is None:
            self._latest = self.source.state_dict()
        while True:
            before = self._latest
            error: BaseException | None = None
            element = None
            try:
                element = next(self.source)
            except StopIteration:
                self._latest = self.source.state_dict()
                raise
            except Exception as e:  # noqa: BLE001 - returned, to take the element's place in the order
                error = e
            after = self.source.state_dict()
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
                self._latest = after
                if seq in self._skip:
                    self._skip.discard(seq)
                    continue
                self._before[seq] = before
                self._order.append(seq)
            return seq, element, error

    def rebase(self) -> None:
        """The input was moved on without the log (nothing in flight): read its position afresh."""
        with self._lock:
            self._latest = None

    def delivered(self, seq: int) -> None:
        """Mark element ``seq`` as handed to the consumer."""
        with self._lock:
            del self._before[seq]
            if self._order[0] == seq:
                self._order.popleft()
                while self._order and self._order[0] in self._delivered_ahead:
                    self._delivered_ahead.discard(self._order.popleft())
            else:
                self._delivered_ahead.add(seq)

    def state_after(self, seq: int) -> dict[str, Any]:
        """The input's state right after element ``seq`` (pulled, not delivered) was pulled.

        For inputs pulled and delivered in order, as an inner reader's are (nothing skipped)."""
        with self._lock:
            assert self._latest is not None  # set by the first pull
            return self._before.get(seq + 1, self._latest)

    def state(self) -> dict[str, Any]:
        with self._lock:
            if not self._order:
                if self._latest is None:
                    self._latest = self.source.state_dict()
                return {"input": self._latest, "seq": self._next_seq, "skip": sorted(self._skip)}
            oldest = self._order[0]
            skip = sorted(self._skip | self._delivered_ahead)
            return {"input": self._before[oldest], "seq": oldest, "skip": skip}

    def set_state(self, state: dict[str, Any], stage: str | None = None) -> None:
        """Resume at ``state``; ``stage`` names the op that owns this log in errors.

        Raises:
            CheckpointError: for a missing key or a value of the wrong type.
        """
        name = stage or f"the consumer of {self.source.name}"
        check_state(name, state, "input", "seq", "skip")
        seq = check_int(name, state, "seq", minimum=0)
        skip = state["skip"]
        if not isinstance(skip, (list, tuple)) or not all(is_int(n) and n >= 0 for n in skip):
            raise CheckpointError(
                f"{name}: state['skip'] must be a list of sequence numbers, got {skip!r}"
            )
        self.source.load_state_dict(state["input"])
        self._latest = state["input"]
        self._next_seq = seq
        self._skip = {int(n) for n in skip}

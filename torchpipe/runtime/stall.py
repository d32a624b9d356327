"""The stall watchdog: the work a parallel stage has out, since when, and the error once it is too long.

Every wait in the runtime is bounded, but a bounded wait that is simply repeated would still hang
on a call that never returns. So a stage marks each piece of work it hands out (a task sent to an
executor, a read that a pool thread starts) with :meth:`StallWatch.begin`, unmarks it when it is
done, and while it waits asks :meth:`StallWatch.check`: the oldest piece out for longer than
``tp.Options(stall_timeout=...)`` raises :class:`~torchpipe.errors.StallError` naming the stage,
the element and where it runs (a thread's name, a worker's pid).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torchpipe.errors import StallError


class StallWatch:
    """When each piece of one stage's outstanding work began; thread-safe.

    Args:
        stage: the stage name, for errors.
        stall_s: the limit in seconds (None: never raise).
        label: what a piece of work is called in the error, before its number.
    """

    def __init__(self, stage: str, stall_s: float | None, label: str = "element") -> None:
        self.stage = stage
        self.stall_s = stall_s
        self._label = label
        self._lock = threading.Lock()
        self._out: dict[int, tuple[float, str | None]] = {}  # oldest first: begin() re-inserts

    def begin(self, seq: int, where: str | None = None) -> None:
        """Work ``seq`` starts now (again, if it was out: a reader's next read), running ``where``."""
        began = time.monotonic()
        with self._lock:
            self._out.pop(seq, None)
            self._out[seq] = (began, where)

    def again(self, seq: int) -> None:
        """Work ``seq``, if out, starts its own part now (it waited for other work): its clock
        starts again, where it runs kept."""
        began = time.monotonic()
        with self._lock:
            out = self._out.pop(seq, None)
            if out is not None:
                self._out[seq] = (began, out[1])

    def end(self, seq: int) -> bool:
        """Work ``seq`` is done; whether it was out."""
        with self._lock:
            return self._out.pop(seq, None) is not None

    def seqs(self) -> list[int]:
        """The work out now, oldest first."""
        with self._lock:
            return list(self._out)

    def clear(self) -> None:
        with self._lock:
            self._out.clear()

    def check(self, where: Callable[[int], str] | None = None) -> None:
        """Raise if the oldest work out has been out longer than the limit.

        Args:
            where: where work ``seq`` runs, for work begun without saying.

        Raises:
            StallError: naming the stage, the work's number and where it runs.
        """
        if self.stall_s is None:
            return
        with self._lock:
            if not self._out:
                return
            seq = next(iter(self._out))
            began, place = self._out[seq]
        waited = time.monotonic() - began
        if waited <= self.stall_s:
            return
        place = place or (where(seq) if where is not None else "a pool")
        raise StallError(
            f"{self.stage}: {self._label} {seq} has been running for {waited:.0f} s on {place} "
            f"(the limit is tp.Options(stall_timeout={self.stall_s:g}); None turns the check off)",
            stage=self.stage,
            seq=seq,
            where=place,
        )

"""Measuring whether a function holds the GIL, to choose between threads and processes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torchpipe.runtime.cpu import run_delay

_PROBE_SLEEP_S = 0.0002
CALIBRATE_S = 0.005
"""Seconds of each of the calibration's windows (the probe's free rate: the fastest of them)."""
_CALIBRATIONS = 2
MIN_TICKS = 5
"""Ticks the probe must be able to make in a measurement (at its free rate) for the GIL-free share
it reads to count whole. It resolves a share to one tick: from 5 ticks on, to a fifth or better,
half the span (0.6 to 1, :data:`~torchpipe.runtime.placement.costs.THREAD_FREE_SHARE`) over which
threads are predicted to start overlapping calls. Over a window of 2-3 ticks (one ``blobs`` batch,
0.5 ms: the first measurement holds no more of its 2 MB results) one tick more or less reads 0.4
more or less free (0.0-0.77 in fresh processes; 0.7-0.77 predicted threads 1.2-1.6x faster than
inline, where they ran 2.7x slower: #59). A shorter window's share counts in proportion
(:meth:`GilProbe.resolved`)."""


class _Ticker:
    """The probe's thread, one a process, started at the first probe and kept: while a probe is
    open it wakes every 0.2 ms and needs the GIL for an instant (a tick); while none is, it waits
    on an event. Starting a thread costs a first measurement 1-2 ms on a busy machine (it waits
    for a core and for the GIL), where a cheap stage's first epoch takes 20 ms."""

    _here: _Ticker | None = None  # this process's (a forked child starts its own)
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.ticks = 0
        self.native_id: int | None = None
        self._open = 0  # probes open now
        self._ticking = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchpipe-gil-probe", daemon=True)
        self._thread.start()
        self._started.wait(timeout=1.0)

    @classmethod
    def opened(cls) -> _Ticker:
        """This process's ticker (started now the first time), ticking until :meth:`close`."""
        with cls._lock:
            ticker = cls._here
            if ticker is None:
                ticker = cls._here = cls()
            ticker._open += 1
            ticker._ticking.set()
        return ticker

    def close(self) -> None:
        """One probe fewer; the thread waits once none is open."""
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._ticking.clear()

    @classmethod
    def _forget(cls) -> None:
        """In a forked child: the parent's thread is not there (the next probe starts one)."""
        cls._here = None
        cls._lock = threading.Lock()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self._started.set()
        while True:
            self._ticking.wait()
            time.sleep(_PROBE_SLEEP_S)
            self.ticks += 1


os.register_at_fork(after_in_child=_Ticker._forget)


class GilProbe:
    """A thread that wakes every 0.2 ms and needs the GIL for an instant; a context manager.

    While code on another thread runs Python it gets the GIL only at the interpreter's switch
    interval (5 ms), so it ticks rarely; while that code is inside C code that released the GIL
    (numpy, torch, PIL, I/O) it ticks as often as when the other thread sleeps. Other threads
    that take the GIL meanwhile (a training loop's logger, a monitor) also slow it down, so one
    measurement can only understate how free the GIL was. On a busy machine the probe also waits
    for a core: the time it waited runnable (:func:`~torchpipe.runtime.cpu.run_delay`) is left
    out of the time it could have ticked in, in the calibration and in every measurement, up to
    half of it (the probe also waits for a core while the GIL is held, where leaving all of it
    out would make Python code look GIL-free). The thread is the process's :class:`_Ticker`,
    which probes share (one probe's ticks are those counted while it measures).
    """

    _calibrated: float | None = None  # the free rate measured first in this process

    def __init__(self) -> None:
        self._ticker: _Ticker | None = None
        self._free_rate = 1.0

    def __enter__(self) -> GilProbe:
        self._ticker = _Ticker.opened()
        if GilProbe._calibrated is not None:  # the rate is the machine's: measured once a process
            self._free_rate = GilProbe._calibrated
            return self
        rates = []
        for _ in range(_CALIBRATIONS):  # the fastest: another thread's burst only slows one down
            before, delay = self._ticks, self._delay()
            time.sleep(CALIBRATE_S)
            could_tick = max(CALIBRATE_S - (self._delay() - delay), CALIBRATE_S / 2)
            rates.append((self._ticks - before) / could_tick)
        self._free_rate = GilProbe._calibrated = max(max(rates), 1.0 / CALIBRATE_S)
        return self

    @classmethod
    def calibrate(cls) -> None:
        """Measure the free rate now, once a process (a probe started later skips it)."""
        if cls._calibrated is None:
            with cls():
                pass

    @classmethod
    @contextlib.contextmanager
    def uncalibrated(cls) -> Iterator[None]:
        """A seam for tests: within the block no free rate is known, as in a new process (the next
        probe calibrates afresh); this process's own is put back after the block."""
        before, GilProbe._calibrated = GilProbe._calibrated, None
        try:
            yield
        finally:
            GilProbe._calibrated = before

    def __exit__(self, *exc: Any) -> None:
        if self._ticker is not None:
            self._ticker.close()
            self._ticker = None

    @property
    def _ticks(self) -> int:
        assert self._ticker is not None  # open: within the block
        return self._ticker.ticks

    def _delay(self) -> float:
        """Seconds the probe thread has waited for a core (0 where unknown)."""
        native_id = self._ticker.native_id if self._ticker is not None else None
        return (run_delay(native_id) or 0.0) if native_id is not None else 0.0

    def resolved(self, share: float, seconds: float) -> float:
        """``share``, a GIL-free share measured over ``seconds`` in all, as far as the probe could
        resolve it: whole where it could tick :data:`MIN_TICKS` times in them, else in proportion
        (towards held: a share the probe cannot resolve is not evidence that threads overlap)."""
        return share * min(1.0, self._free_rate * max(seconds, 0.0) / MIN_TICKS)

    def measure(self, call: Callable[[], Any]) -> tuple[Any, float, float]:
        """``(result, free_fraction, seconds)``: ``call()``'s result, the share of its duration
        during which the GIL was free (0..1), and how long it took."""
        before, delay = self._ticks, self._delay()
        t0 = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - t0
        observed = self._ticks - before
        # less the probe's wait for a core
        could_tick = max(seconds - (self._delay() - delay), seconds / 2)
        return result, min(1.0, observed / max(self._free_rate * could_tick, 1e-9)), seconds

"""Ctrl-C that lands in a finalizer is not lost.

Python runs a ``weakref.finalize`` callback (or a ``__del__``) wherever an object dies, and an
exception raised inside it, ``KeyboardInterrupt`` included, is printed ("Exception ignored in
...") and dropped: the program goes on as if Ctrl-C had not been pressed. The runtime frees ring
records and recycled batches from finalizers, one for each batch the training loop drops, so a
Ctrl-C has a fair chance of landing in one (1 in 25 under load, measured). :func:`watch` chains a
``sys.unraisablehook`` that notes a dropped ``KeyboardInterrupt``, and the iterators the training
loop calls raise it at their next call (:func:`raise_dropped`).
"""

from __future__ import annotations

import sys
from typing import Any

from torchpipe.runtime.forks import ForkSafeLock

_lock = ForkSafeLock()
_dropped = False


def watch() -> None:
    """Note ``KeyboardInterrupt`` s that finalizers drop from now on (idempotent; the hook in
    place before is still called)."""
    with _lock:
        if getattr(sys.unraisablehook, "_torchpipe_interrupts", False):
            return
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            global _dropped
            if isinstance(unraisable.exc_type, type) and issubclass(
                unraisable.exc_type, KeyboardInterrupt
            ):
                _dropped = True
            previous(unraisable)

        hook._torchpipe_interrupts = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook


def raise_dropped() -> None:
    """Raise ``KeyboardInterrupt`` if a finalizer dropped one since the last call.

    Raises:
        KeyboardInterrupt: for a Ctrl-C that a finalizer dropped.
    """
    global _dropped
    if _dropped:
        _dropped = False
        raise KeyboardInterrupt

"""Where a ``prefetch(tp.AUTOTUNE)`` runs its input: on its thread or inline, by measurement.

The prefetch's own rule, beside the executor policy's (``policy.py``): it compares what the
consumer got per element in each mode, with the policy's ``MARGIN`` for the dearer thread.
"""

from __future__ import annotations

from torchpipe.runtime.placement.costs import INLINE, THREAD
from torchpipe.runtime.placement.policy import MARGIN


def choose_overlap(
    current: str, measured: dict[str, float], pull_s: float, consumer_s: float, retry_thread: bool
) -> str:
    """Where a prefetch runs its input, :data:`THREAD` (overlapped with the consumer) or
    :data:`INLINE` (on the consumer's thread), after a window on ``current``.

    Measured on both, the thread, dearer in CPU and memory, stays only where it was ``MARGIN``
    times faster. Inline not measured (lately) is tried where its guess (the input's time per
    element plus the consumer's own) comes within ``MARGIN`` of the thread's measure. The thread
    not measured (lately) is tried where ``retry_thread`` (the consumer changed since), or where
    its guess, the longer of the two times (at best the thread hides the shorter), is ``MARGIN``
    times faster than inline measured: a consumer that works between its requests about as long
    as an element takes to make.

    Args:
        current: the mode the window ran in (in ``measured``).
        measured: seconds per element the consumer got in each mode, within their stale time.
        pull_s: the input's time per element.
        consumer_s: the consumer's own time per element, between its requests.
        retry_thread: whether an inline prefetch should measure its thread again.
    """
    other = INLINE if current == THREAD else THREAD
    if other not in measured:
        if other == INLINE:
            return INLINE if pull_s + consumer_s < MARGIN * measured[current] else current
        overlaps = MARGIN * max(pull_s, consumer_s) < measured[current]
        return THREAD if retry_thread or overlaps else current
    return THREAD if measured[THREAD] * MARGIN < measured[INLINE] else INLINE

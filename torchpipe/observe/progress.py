"""Progress bars for long writes (``save``, ``snapshot``, ``cache(path)`` fills), through tqdm.

A bar is drawn only when its stream is a terminal: in a log file, a notebook's captured output or
CI it is silent (tqdm's ``disable=None``). Without tqdm installed (``pip install
'torchpipe[progress]'``) there is no bar, and one warning says so if a terminal would have shown it.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from torchpipe.constants import INFINITE, UNKNOWN

_warned = False


class ProgressBar:
    """A tqdm bar, or nothing; ``update`` costs a counter increment between redraws.

    Args:
        desc: what is being written, e.g. ``save(/data/train)``.
        total: elements expected (``tp.UNKNOWN`` or ``tp.INFINITE``: no total).
        initial: elements already done (a resumed write).
        stream: where it is drawn (default ``sys.stderr``).
    """

    def __init__(
        self, desc: str, total: int | None = None, initial: int = 0, stream: Any = None
    ) -> None:
        stream = sys.stderr if stream is None else stream
        self._bar = None
        if not _is_terminal(stream):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            _warn_once()
            return
        total = None if total in (None, INFINITE, UNKNOWN) else int(total)
        self._bar = tqdm(
            desc=desc,
            total=total,
            initial=initial,
            unit=" elem",
            file=stream,
            disable=None,
            dynamic_ncols=True,
            leave=True,
            mininterval=0.25,
        )

    @property
    def active(self) -> bool:
        """Whether a bar is being drawn."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def missing_tqdm_unwarned() -> Iterator[None]:
    """A seam for tests: within the block the warning that tqdm is missing is not said yet, as in
    a new process; whether this process said it is put back after the block."""
    global _warned
    before, _warned = _warned, False
    try:
        yield
    finally:
        _warned = before


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "torchpipe draws progress bars with tqdm, which is not installed: "
            "pip install 'torchpipe[progress]'",
            stacklevel=3,
        )

"""Noticing that a ``tp.DataLoader`` is being rebuilt as another library's loader.

Hugging Face Accelerate (and so transformers' Trainer) does not iterate the loader it is given: it
reads its attributes and builds a torch ``DataLoader`` from them, so torchpipe's workers, resume
and device prefetch are silently gone. Such a rebuild reads every constructor argument, among
them ``multiprocessing_context``, which ``tp.DataLoader`` serves through a property (torch's is a
property too); the property calls :func:`notice_read` with the reader's frame. The check is one
dictionary look-up of the reader's module name: torch's and torchpipe's own reads (an epoch
starting) and Lightning's re-creation (with the loader's own class) are not rebuilds that lose
torchpipe, and are never warned about.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from types import FrameType

REBUILDERS = {
    "accelerate": "torchpipe.integrations.accelerate.use_torchpipe(accelerator) keeps it (a Trainer: "
    "torchpipe.integrations.accelerate.TrainerMixin); docs/integrations.md",
}
"""The top-level packages whose reads are rebuilds, and the supported path the warning names."""


class _Expected(threading.local):
    depth = 0  # open expected() blocks in this thread


_state = _Expected()
warned = False  # once a process: the first rebuild says it all (tests reset it)


def notice_read(frame: FrameType | None) -> None:
    """Warn once if ``frame`` (the reader of a loader attribute) belongs to a known rebuilder."""
    global warned
    if warned or frame is None or _state.depth:
        return
    reader = frame.f_globals.get("__name__", "")
    hint = REBUILDERS.get(reader.partition(".")[0])
    if hint is None:
        return
    warned = True
    warnings.warn(
        f"{reader} is rebuilding a torchpipe.DataLoader as another loader: its batches will come from torch's "
        f"DataLoader, without torchpipe's workers, exact resume or device prefetch. {hint}",
        UserWarning,
        stacklevel=_user_level(frame),
    )


def _user_level(frame: FrameType) -> int:
    """The ``stacklevel`` that points at the user's line (the first frame outside the libraries)."""
    level = 3  # notice_read, the property, the reader
    while (
        frame.f_back is not None
        and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES
    ):
        frame, level = frame.f_back, level + 1
    return level


_LIBRARIES = {*REBUILDERS, "transformers", "torch", "torchpipe"}


@contextlib.contextmanager
def expected() -> Iterator[None]:
    """Reads within this block are rebuilds torchpipe asked for (its own integrations)."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1

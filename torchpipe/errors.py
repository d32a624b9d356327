"""Exception helpers: notes that name the stage, and the errors torchpipe raises itself."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678), also on Python 3.10 where ``add_note`` is missing."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        notes = []
        try:
            exc.__notes__ = notes  # type: ignore[attr-defined]
        except AttributeError:
            return
    notes.append(note)


class CheckpointError(ValueError):
    """A state dict does not belong to this pipeline or is malformed."""


class WorkerError(RuntimeError):
    """A worker process died (killed by a signal, crashed, or exited) while running tasks.

    Attributes:
        pid: the worker's process id.
        how: how it ended, e.g. ``killed by SIGKILL``.
    """

    def __init__(self, message: str, pid: int | None = None, how: str | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.how = how

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.pid, self.how)


class StallError(RuntimeError):
    """An element of a parallel stage has been out longer than ``tp.Options(stall_timeout=...)``.

    Attributes:
        stage: the stage, e.g. ``map(decode)``.
        seq: the element's sequence number at that stage.
        where: where it runs, e.g. ``worker process 4242``.
    """

    def __init__(
        self,
        message: str,
        stage: str | None = None,
        seq: int | None = None,
        where: str | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.seq = seq
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.stage, self.seq, self.where)


class UntrustedTypeError(pickle.UnpicklingError):
    """A file torchpipe reads (a saved dataset, snapshot, cache file or checkpoint) names a type or
    function outside the allow-list (``tp.add_safe_globals``); nothing of it was called.

    Attributes:
        name: what the file names, ``module.qualified_name``.
    """

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.name)


class DataLossError(ValueError):
    """A record file is corrupt or truncated.

    Attributes:
        path: the file (or URL).
        offset: the byte offset of the damaged record (in the uncompressed stream for GZIP and
            ZLIB files), or of the damage itself where no record could be framed.
    """

    def __init__(self, message: str, path: str | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.path, self.offset)


class DecodeError(ValueError):
    """An image could not be decoded: malformed, truncated, or not the format asked for.

    Attributes:
        path: the file, where the image was read from one (``None`` for bytes).
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.path)


class DiskFullError(OSError):
    """A write ran out of room: a full disk or quota (``ENOSPC``, ``EDQUOT``), or a file past the
    process's file-size limit (``EFBIG`` under ``RLIMIT_FSIZE``).

    An ``OSError`` with the original ``errno`` and ``strerror`` (``e.errno == errno.ENOSPC`` still
    tells), raised from the original error. The writer that raises it has removed its temporary
    file and published nothing under the final name.

    Attributes:
        stage: the writer, e.g. ``cache(/data/train.cache)`` or ``save(/data/train)``.
        filename: the file being written when the write failed (often a temporary name).
        written: the bytes written to ``filename`` before the failure.
    """

    def __init__(
        self,
        message: str,
        errno: int | None = None,
        stage: str | None = None,
        filename: str | None = None,
        written: int | None = None,
    ) -> None:
        # torch's DataLoader re-raises a worker's exception as ``type(e)(its text)``
        if errno is None:
            found = re.search(r"\[Errno (\d+)\]", message)
            errno = int(found.group(1)) if found else None
        super().__init__(errno, os.strerror(errno) if errno is not None else message)
        self.message = message
        self.stage = stage
        self.filename = filename
        self.written = written

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # The state keeps PEP 678 notes (the stage that stored, the worker's traceback).
        return (
            type(self),
            (self.message, self.errno, self.stage, self.filename, self.written),
            self.__dict__,
        )

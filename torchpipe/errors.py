"""Exception helpers: notes that name the stage, and the errors torchpipe raises itself."""

from __future__ import annotations


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

    def __reduce__(self):
        return type(self), (self.args[0], self.pid, self.how)


class StallError(RuntimeError):
    """An element of a parallel stage has been out longer than ``tp.Options(stall_timeout=...)``.

    Attributes:
        stage: the stage, e.g. ``map(decode)``.
        seq: the element's sequence number at that stage.
        where: where it runs, e.g. ``worker process 4242``.
    """

    def __init__(self, message: str, stage: str | None = None, seq: int | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.seq = seq
        self.where = where

    def __reduce__(self):
        return type(self), (self.args[0], self.stage, self.seq, self.where)


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

    def __reduce__(self):
        return type(self), (self.args[0], self.path, self.offset)

"""Files written under a temporary name and published under their final name once complete.

Every torchpipe writer of files writes through :class:`PendingFile`: ``cache`` files, the shards,
manifest and checkpoint of ``save`` and ``snapshot``, ``tp.io.TFRecordWriter`` and
``tp.io.TarWriter``. So a file under its final name is always complete, and a write that runs
out of room (a full disk or quota, or a file past ``RLIMIT_FSIZE``) raises one error,
:class:`~torchpipe.errors.DiskFullError`, naming the writer, the file and the bytes written,
after which the writer removes its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

from torchpipe.errors import DiskFullError

_FULL = {errno.ENOSPC: "disk full", errno.EFBIG: "file size limit reached"}
if hasattr(errno, "EDQUOT"):  # not on Windows
    _FULL[errno.EDQUOT] = "disk quota exceeded"


def temp_name(path: str) -> str:
    """A fresh temporary name next to ``path``: ``<path>.tmp-<pid>-<8 hex digits>``."""
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def is_full(error: BaseException) -> bool:
    """Whether ``error`` says a write ran out of room (``ENOSPC``, ``EDQUOT``, ``EFBIG``)."""
    return (
        isinstance(error, OSError) and not isinstance(error, DiskFullError) and error.errno in _FULL
    )


def disk_full_error(error: OSError, stage: str, filename: str, written: int) -> DiskFullError:
    """The :class:`DiskFullError` for ``error``, a write of ``filename`` that ran out of room."""
    reason = _FULL.get(error.errno or 0, "out of room")
    return DiskFullError(
        f"{stage}: {reason} after writing {written:,} bytes to {filename}: [Errno {error.errno}] "
        f"{error.strerror}",
        error.errno,
        stage,
        filename,
        written,
    )


@contextlib.contextmanager
def reporting_full_disk(stage: str, filename: str, written: Callable[[], int]) -> Iterator[None]:
    """Turn an ``OSError`` that says the disk is full into a :class:`DiskFullError` (``from`` it)
    naming ``written()`` bytes.

    Raises:
        DiskFullError: for ``ENOSPC``, ``EDQUOT`` or ``EFBIG``; other errors pass unchanged.
    """
    try:
        yield
    except OSError as e:
        if is_full(e):
            raise disk_full_error(e, stage, filename, written()) from e
        raise


class PendingFile:
    """A binary file written under a temporary name, then published under its final name.

    A write, flush or close that runs out of room raises :class:`DiskFullError` naming the
    bytes that reached the file. Publishing is :meth:`publish` (on disk, then renamed), giving up is
    :meth:`discard` (closed, temporary file removed). A ``temp`` equal to ``path`` writes in
    place (a URL, which fsspec publishes when it is closed): nothing is renamed or removed.

    Args:
        file: the temporary file, open for writing.
        temp: its name.
        path: the final name.
        stage: names the writer in errors, e.g. ``cache(/data/x)``.
        written: the bytes already in the file (one reopened to go on writing).
    """

    def __init__(self, file: BinaryIO, temp: str, path: str, stage: str, written: int = 0) -> None:
        self.file, self.temp, self.path, self.stage = file, temp, path, stage
        self.written = written

    @classmethod
    def create(cls, path: str, stage: str, buffering: int = -1) -> PendingFile:
        """A new temporary file next to ``path`` (see :func:`temp_name`).

        Raises:
            FileNotFoundError: if ``path``'s directory does not exist.
            DiskFullError: if the disk has no room for the file's entry.
        """
        temp = temp_name(path)
        with reporting_full_disk(stage, temp, lambda: 0):
            return cls(open(temp, "xb", buffering=buffering), temp, path, stage)

    def reporting(self) -> contextlib.AbstractContextManager[None]:
        """Errors that say the disk is full become :class:`DiskFullError` naming this file and
        the bytes it holds."""
        return reporting_full_disk(self.stage, self.temp, self._size)

    def _size(self) -> int:
        """The bytes that reached the file, or (where that cannot be told) those written to it."""
        try:
            return os.fstat(self.file.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            return self.written

    def write(self, data: Any) -> None:
        """Append ``data`` (any bytes-like object)."""
        with self.reporting():
            self.file.write(data)
        self.written += memoryview(data).nbytes

    def flush(self, sync: bool = False) -> None:
        """Hand what was written to the kernel; with ``sync``, to the disk."""
        with self.reporting():
            self.file.flush()
            if sync:
                os.fsync(self.file.fileno())

    def close(self, sync: bool = True) -> None:
        """Flush (with ``sync``, to the disk) and close the file, keeping it under its temporary name."""
        if self.file.closed:
            return
        with self.reporting():
            try:
                self.flush(sync)
            finally:
                self.file.close()

    def publish(self) -> None:
        """Close the file (on disk) and rename it to its final name, replacing a file there."""
        if self.temp == self.path:
            self.close(sync=False)  # a URL: no local file to sync; its store publishes it on close
            return
        self.close(sync=True)
        os.replace(self.temp, self.path)

    def abort(self) -> None:
        """Close the file, dropping what it could not write, and leave it under its temporary
        name (to be resumed); never raises for a file that cannot be flushed (on a full disk it
        cannot)."""
        with contextlib.suppress(OSError, ValueError):
            self.file.close()

    def discard(self) -> None:
        """Close the file as :meth:`abort` does and remove it."""
        self.abort()
        if self.temp != self.path:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.temp)


_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows
_BINARY = getattr(os, "O_BINARY", 0)  # Windows only


def create_exclusive(path: str, buffering: int = -1) -> BinaryIO:
    """A new file at ``path``, open for writing: ``O_EXCL``, so never a file or symlink that is
    there already (one planted in a shared directory would redirect the write).

    Raises:
        FileExistsError: if anything is at ``path``.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | _BINARY, 0o666)
    return os.fdopen(fd, "wb", buffering=buffering)


def open_no_follow(path: str, mode: str, buffering: int = -1) -> BinaryIO:
    """``open(path, mode)`` for ``"rb"``, ``"r+b"`` or ``"a+b"`` (created if missing), refusing a
    symlink at ``path`` (``O_NOFOLLOW``: an ``OSError``, ``ELOOP``)."""
    flags = {"rb": os.O_RDONLY, "r+b": os.O_RDWR, "a+b": os.O_RDWR | os.O_CREAT | os.O_APPEND}[mode]
    fd = os.open(path, flags | _NO_FOLLOW | _BINARY, 0o666)
    return cast(BinaryIO, os.fdopen(fd, mode, buffering=buffering))


def write_file(path: str, data: bytes, stage: str) -> None:
    """Publish ``data`` at ``path`` atomically: a reader finds the old file, the new one, or none.

    Raises:
        DiskFullError: if the disk is full (nothing is left behind).
    """
    pending = PendingFile.create(path, stage)
    try:
        pending.write(data)
        pending.publish()
    except BaseException:
        pending.discard()
        raise

"""Paths with a scheme (``s3://``, ``gs://``, ``http(s)://``, ...) opened through fsspec, with
retries: a read that fails part way is retried from the byte it had reached, and the error
that ends the retries names the URL and that byte.

fsspec and the S3 backend are the ``remote`` extra (``pip install 'torchpipe[remote]'``);
other backends (``gcsfs`` for ``gs://``, ``adlfs`` for ``az://``) are installed as fsspec
asks. Credentials, endpoints and other backend options come from fsspec's own configuration
(``fsspec.config.conf`` or ``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables).
"""

from __future__ import annotations

import dataclasses
import io
import re
import time
from collections.abc import Callable
from typing import Any, BinaryIO

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
EXTRA = "pip install 'torchpipe[remote]'"
DEFAULT_REMOTE_BUFFER = 8 << 20
"""Bytes fetched by one request of a sequential remote read (object stores answer each request
tens of milliseconds late, so small requests starve a reader)."""

_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ImportError,
)


class RemoteReadError(OSError):
    """A read of a URL failed on every attempt the retry policy allows.

    Attributes:
        url: the URL.
        offset: the byte the read had reached.
    """

    def __init__(self, message: str, url: str | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.offset = offset

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.args[0], self.url, self.offset)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a failed read of a URL is retried.

    A read that raises is retried up to ``attempts`` times in all, waiting ``backoff_s``, then
    twice that, and so on up to ``max_backoff_s``; each retry opens the URL again and resumes at
    the byte the read had reached, so nothing is read twice into a record. Errors that no retry
    can mend (not found, permission denied, a missing package) are raised at once. Backends
    retry too (s3fs retries throttling and dropped connections itself); this policy is the last
    line, and its final error names the URL and the byte.

    Attributes:
        attempts: tries of one read in all (1: no retry).
        backoff_s: the wait before the first retry.
        max_backoff_s: the longest wait between two tries.
    """

    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.attempts, bool)
            or not isinstance(self.attempts, int)
            or self.attempts < 1
        ):
            raise ValueError(f"RetryPolicy: attempts must be an int >= 1, got {self.attempts!r}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy: backoff_s and max_backoff_s must be >= 0")

    def wait_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return min(self.backoff_s * (2**retry), self.max_backoff_s)

    def call(self, url: str, offset: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried by this policy; errors name ``url`` and ``offset``.

        Raises:
            RemoteReadError: when every attempt failed.
        """
        for attempt in range(self.attempts):
            try:
                return fn()
            except _PERMANENT:
                raise
            except Exception as e:
                if attempt + 1 == self.attempts:
                    raise RemoteReadError(
                        f"reading {url} failed at byte {offset} after {self.attempts} "
                        f"attempt(s): {type(e).__name__}: {e}",
                        url,
                        offset,
                    ) from e
                time.sleep(self.wait_s(attempt))
        raise AssertionError("unreachable")


def is_url(path: str) -> bool:
    """Whether ``path`` has a scheme other than ``file://`` (and so goes through fsspec)."""
    match = _SCHEME.match(path)
    return match is not None and match.group(1).lower() != "file"


def local_path(path: str) -> str:
    """``path`` without a ``file://`` prefix."""
    return path[len("file://") :] if path.lower().startswith("file://") else path


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path within it.

    Raises:
        ImportError: naming the extra (or the backend package) to install.
    """
    try:
        import fsspec.core
    except ImportError as e:
        raise ImportError(f"opening {url} needs fsspec: {EXTRA}") from e
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise ImportError(
            f"opening {url} needs fsspec's backend for its scheme ({EXTRA} covers s3://; "
            f"fsspec says: {e})"
        ) from e


def open_url(
    url: str, mode: str, buffer_size: int | None = None, retry: RetryPolicy | None = None
) -> BinaryIO:
    """``url`` opened in binary ``mode`` (``"rb"`` or ``"wb"``); reads retry by ``retry``."""
    fs, path = filesystem(url)
    if mode == "wb":
        return fs.open(path, "wb")
    size = buffer_size or DEFAULT_REMOTE_BUFFER
    raw = RetryingFile(
        url, lambda: fs.open(path, "rb", block_size=size, cache_type="none"), retry or RetryPolicy()
    )
    return io.BufferedReader(raw, size)


def read_range(url: str, start: int, length: int, retry: RetryPolicy | None = None) -> bytes:
    """Bytes ``[start, start + length)`` of ``url`` in one request (random access)."""
    fs, path = filesystem(url)
    return (retry or RetryPolicy()).call(
        url, start, lambda: fs.cat_file(path, start=start, end=start + length)
    )


def size(url: str) -> int:
    """The size of the object at ``url`` in bytes."""
    fs, path = filesystem(url)
    return int(RetryPolicy().call(url, 0, lambda: fs.size(path)))


def glob(pattern: str) -> list[str]:
    """URLs matching a glob ``pattern`` such as ``s3://bucket/train-*.tfrecord``, sorted."""
    fs, path = filesystem(pattern)
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))


class RetryingFile(io.RawIOBase):
    """A remote file read through a retry policy: a failed read reopens the URL and goes on at
    the byte it had reached.

    Args:
        url: the URL, for errors.
        opener: opens the remote file (at its start).
        policy: the retry policy.
    """

    def __init__(self, url: str, opener: Callable[[], Any], policy: RetryPolicy) -> None:
        super().__init__()
        self._url = url
        self._opener = opener
        self._policy = policy
        self._file: Any = None
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._position
        elif whence == io.SEEK_END:
            offset += self._policy.call(self._url, self._position, lambda: self._opened().size)
        self._position = offset
        if self._file is not None:
            self._file.seek(offset)
        return offset

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._policy.call(self._url, self._position, lambda: self._read(len(view)))
        view[: len(data)] = data
        self._position += len(data)
        return len(data)

    def _opened(self) -> Any:
        if self._file is None:
            self._file = self._opener()
            self._file.seek(self._position)
        return self._file

    def _read(self, n: int) -> bytes:
        try:
            return self._opened().read(n)
        except Exception:
            self._drop()  # the next attempt reopens at self._position
            raise

    def _drop(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is gone either way
                pass

    def close(self) -> None:
        if not self.closed:
            self._drop()
        super().close()

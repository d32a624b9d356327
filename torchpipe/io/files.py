"""Opening the files that readers read and writers write: local paths, URLs through fsspec
(``remote.py``), GZIP/ZLIB streams, brace-expanded shard lists, and the error that names a
corrupt file and the byte where the damage is; and ``tp.io.split_files``, which marks where a
list of files is split across ranks (the split itself is ``distributed/ranks.py``'s).
"""

from __future__ import annotations

import abc
import contextlib
import io
import itertools
import os
import re
import weakref
import zlib
from collections.abc import Callable, Generator, Sequence
from typing import Any, BinaryIO

from torchpipe.arguments import require_bool
from torchpipe.core.iterator import Iterator
from torchpipe.core.state import check_state
from torchpipe.dataset import Dataset
from torchpipe.distributed.nodes import SplitFilesNode
from torchpipe.errors import CheckpointError, DataLossError
from torchpipe.io import remote
from torchpipe.ops.source_nodes import FileListNode, SplitFileList
from torchpipe.storage.pending_file import PendingFile

DEFAULT_BUFFER_SIZE = 256 * 1024
"""Read buffer of a record file (tf.data's default for TFRecordDataset)."""

COMPRESSION_TYPES = {None: None, "": None, "GZIP": "GZIP", "ZLIB": "ZLIB"}
_WBITS = {"GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}
_SKIP_CHUNK = 1 << 20


def check_compression_type(op: str, compression_type: Any) -> str | None:
    """The canonical compression name (``None``, ``"GZIP"`` or ``"ZLIB"``).

    Raises:
        ValueError: for any other value.
    """
    if compression_type not in COMPRESSION_TYPES:
        raise ValueError(
            f"{op}: compression_type must be None, '', 'GZIP' or 'ZLIB', got {compression_type!r}"
        )
    return COMPRESSION_TYPES[compression_type]


def check_path(op: str, path: Any) -> str:
    """``path`` as a str (a PathLike is converted; bytes, as tf.data's file lists hold, are
    decoded as the file system encodes names).

    Raises:
        TypeError: if it is not a str, bytes or PathLike.
    """
    if isinstance(path, (os.PathLike, bytes)):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        raise TypeError(
            f"{op}: a path must be a str, bytes or os.PathLike, got {type(path).__name__}"
        )
    return path


def open_input(
    path: str, buffer_size: int | None, retry: remote.RetryPolicy | None = None
) -> BinaryIO:
    """``path`` opened for reading bytes: local files directly, URLs through fsspec.

    Args:
        buffer_size: bytes read at once (default: 256 KB for local files, 8 MB for URLs).
    """
    if remote.is_url(path):
        return remote.open_url(path, "rb", buffer_size, retry)
    return open(remote.local_path(path), "rb", buffering=buffer_size or DEFAULT_BUFFER_SIZE)


class OutputFile:
    """The file a record writer (``TFRecordWriter``, ``TarWriter``) fills, published when complete.

    A local path is written under a temporary name next to it (``<path>.tmp-<pid>-<random>``)
    and renamed to ``path`` by :meth:`publish`, replacing a file there; a URL is written through
    fsspec, whose store makes it visible when it is closed. If a write fails (a full disk:
    :class:`~torchpipe.errors.DiskFullError`), or the writer is dropped without being closed, the
    temporary file is removed and ``path`` is left as it was.

    Args:
        path: the final name (a local path or a URL).
        stage: names the writer in errors, e.g. ``TFRecordWriter(/data/a.tfrecord)``.
    """

    def __init__(self, path: str, stage: str) -> None:
        if remote.is_url(path):
            self._pending = PendingFile(remote.open_url(path, "wb"), path, path, stage)
        else:
            self._pending = PendingFile.create(remote.local_path(path), stage)
        self.closed = False
        self._finalizer = weakref.finalize(self, self._pending.discard)

    def write(self, data: Any) -> None:
        """Append ``data``; after a failure the file is discarded and the error raised.

        Raises:
            ValueError: once the file is published or discarded.
            DiskFullError: if the disk is full.
        """
        with self._discarding_on_error():
            self._pending.write(data)

    def flush(self) -> None:
        """Hand what was written to the kernel (under the temporary name)."""
        with self._discarding_on_error():
            self._pending.flush()

    def publish(self) -> None:
        """Put the file on disk under its final name."""
        with self._discarding_on_error():
            self._pending.publish()
        self.closed = True
        self._finalizer.detach()

    def discard(self) -> None:
        """Remove the file without publishing it; idempotent."""
        self.closed = True
        self._finalizer()

    @contextlib.contextmanager
    def _discarding_on_error(self) -> Generator[None, None, None]:
        if self.closed:
            raise ValueError(f"{self._pending.stage}: the file is closed")
        try:
            yield
        except BaseException:
            self.discard()
            raise


def open_stream(
    path: str,
    compression: str | None,
    buffer_size: int | None,
    offset: int = 0,
    retry: remote.RetryPolicy | None = None,
) -> BinaryIO:
    """``path`` opened for reading, decompressed, positioned at ``offset`` of the uncompressed
    stream: a seek for plain files, a read of the bytes before it for compressed ones (a
    compressed stream has no other way in).

    Raises:
        DataLossError: if a compressed stream ends before ``offset``.
    """
    raw = open_input(path, buffer_size, retry)
    if compression is None:
        if offset:
            raw.seek(offset)
        return raw
    stream = io.BufferedReader(
        InflateStream(raw, compression, path), buffer_size or DEFAULT_BUFFER_SIZE
    )
    skipped = 0
    while skipped < offset:
        chunk = stream.read(min(_SKIP_CHUNK, offset - skipped))
        if not chunk:
            stream.close()
            raise DataLossError(
                f"{path}: the {compression} stream ends at byte {skipped}, before the checkpoint's "
                f"offset {offset}; has the file changed?",
                path,
                skipped,
            )
        skipped += len(chunk)
    return stream


class InflateStream(io.RawIOBase):
    """A GZIP or ZLIB compressed file read as its uncompressed bytes.

    Concatenated GZIP members are read one after another, as ``gzip`` does. A stream that ends
    inside a member, or bytes that do not inflate, raise :class:`DataLossError` naming the file
    and the compressed offset.

    Args:
        raw: the compressed file, positioned at its start.
        compression: ``"GZIP"`` or ``"ZLIB"``.
        path: the file's name, for errors.
    """

    def __init__(self, raw: BinaryIO, compression: str, path: str) -> None:
        super().__init__()
        self._raw = raw
        self._wbits = _WBITS[compression]
        self._compression = compression
        self._path = path
        self._inflate = zlib.decompressobj(self._wbits)
        self._input = b""
        self._in_member = False  # whether the current GZIP member (or ZLIB stream) has begun
        self._consumed = 0  # compressed bytes fed to zlib, for errors

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            if not self._input:
                self._input = self._raw.read(DEFAULT_BUFFER_SIZE)
                if not self._input:
                    return self._end_of_input()
            self._in_member = True
            try:
                out = self._inflate.decompress(self._input, len(view))
            except zlib.error as e:
                raise DataLossError(
                    f"{self._path}: corrupt {self._compression} data near compressed byte "
                    f"{self._consumed} ({e})",
                    self._path,
                    self._consumed,
                ) from e
            self._consumed += len(self._input) - len(self._inflate.unconsumed_tail)
            self._input = self._inflate.unconsumed_tail
            if self._inflate.eof:
                self._next_member()
            if out:
                view[: len(out)] = out
                return len(out)

    def _next_member(self) -> None:
        rest = self._inflate.unused_data
        self._consumed -= len(rest)
        self._inflate = zlib.decompressobj(self._wbits)
        self._in_member = False
        # Concatenated GZIP members are one stream; tf.data reads one ZLIB stream, nothing after.
        self._input = rest if self._compression == "GZIP" else b""

    def _end_of_input(self) -> int:
        if self._in_member:
            raise DataLossError(
                f"{self._path}: the {self._compression} stream is truncated at compressed byte "
                f"{self._consumed}",
                self._path,
                self._consumed,
            )
        return 0

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class FileReaderIterator(Iterator):
    """Base of the iterators that read one file from start to end; the state is
    ``{file, offset, done}``, ``offset`` being where the next element starts.

    A subclass opens its stream in :meth:`start` (at ``self._offset``) and reads the next
    element in :meth:`read_next` (raising StopIteration at the end). Any error ends the file
    after it is raised once, so that under ``ignore_errors()`` reading goes on at the next file
    (as in tf.data); :class:`DataLossError` s are counted in ``stats.counters["corrupt"]``.

    Args:
        name: the stage name.
        path: the file (or URL) read.
    """

    FILE, OFFSET, DONE, CORRUPT = "file", "offset", "done", "corrupt"

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self._offset = 0
        self._done = False
        self._stream: BinaryIO | None = None

    @abc.abstractmethod
    def read_next(self) -> Any:
        """The next element; StopIteration at the end of the file."""

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self.read_next()
        except BaseException as e:
            if isinstance(e, DataLossError):
                self.stats.counters[self.CORRUPT] = self.stats.counters.get(self.CORRUPT, 0) + 1
            self._done = True
            self.shutdown()
            raise

    def get_state(self) -> dict[str, Any]:
        return {self.FILE: self.path, self.OFFSET: self._offset, self.DONE: self._done}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.FILE, self.OFFSET, self.DONE)
        if state[self.FILE] != self.path:
            raise CheckpointError(
                f"{self.name}: the checkpoint is of file {state[self.FILE]!r}, not {self.path!r}"
            )
        self._offset, self._done = int(state[self.OFFSET]), bool(state[self.DONE])

    def shutdown(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


# -- shard lists ----------------------------------------------------------------------------------
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Every name a brace pattern stands for, in order, as the shell and WebDataset expand them.

    ``shard-{000000..000002}.tar`` -> ``shard-000000.tar``, ``shard-000001.tar``,
    ``shard-000002.tar`` (a range keeps the width of its first bound); ``{a,b}`` alternatives;
    several groups multiply out, leftmost slowest.

    Raises:
        ValueError: for a range that counts down.
    """
    pieces: list[list[str]] = []
    last = 0
    for match in _BRACES.finditer(pattern):
        pieces.append([pattern[last : match.start()]])
        pieces.append(_alternatives(match.group(1), pattern))
        last = match.end()
    pieces.append([pattern[last:]])
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _alternatives(body: str, pattern: str) -> list[str]:
    found = _RANGE.match(body)
    if found is None:
        return body.split(",")
    first, last = found.groups()
    low, high = int(first), int(last)
    if high < low:
        raise ValueError(f"brace range {{{body}}} in {pattern!r} counts down")
    width = len(first.lstrip("-"))
    return [
        str(k).zfill(width) if k >= 0 else "-" + str(-k).zfill(width) for k in range(low, high + 1)
    ]


def path_dataset(op: str, filenames: Any, braces: bool = False) -> Dataset:
    """A dataset of paths from a path, a list of paths, or a ``tp.Dataset`` of them.

    Args:
        op: the calling function, for errors.
        filenames: a str or PathLike, a sequence of them, or a ``tp.Dataset`` yielding them.
        braces: expand ``{a,b}`` and ``{000..010}`` in each path (WebDataset shard lists).

    Raises:
        TypeError: for anything else.
        ValueError: for an empty list.
    """
    if isinstance(filenames, Dataset):
        return filenames
    if isinstance(filenames, (str, os.PathLike)):
        paths = [check_path(op, filenames)]
    elif isinstance(filenames, Sequence) or hasattr(filenames, "tolist"):
        items = filenames.tolist() if hasattr(filenames, "tolist") else list(filenames)
        paths = [check_path(op, p) for p in items]
    else:
        raise TypeError(
            f"{op}: filenames must be a path, a list of paths or a tp.Dataset, got "
            f"{type(filenames).__name__}"
        )
    if braces:
        paths = [name for path in paths for name in expand_braces(path)]
    if not paths:
        raise ValueError(f"{op}: no filenames given")
    # tp.distributed.share_of_files' share: not split again
    if isinstance(filenames, SplitFileList):
        paths = SplitFileList(paths, filenames.share)
    return Dataset(FileListNode(paths))


def read_each(
    files: Dataset, reader: Callable[[Any], Dataset], num_parallel_reads: int | None
) -> Dataset:
    """The elements of every file in ``files``, each file read by ``reader``: one file after
    another (``num_parallel_reads=None``), or ``num_parallel_reads`` files (or ``tp.AUTOTUNE``)
    interleaved, an element from each in turn, read ahead in parallel."""
    if num_parallel_reads is None:
        return files.flat_map(reader)
    return files.interleave(
        reader, cycle_length=num_parallel_reads, num_parallel_calls=num_parallel_reads
    )


def split_files(files: Dataset, *, shuffled: bool = False) -> Dataset:
    """``files`` (a dataset of file names) split across ranks: each rank reads every
    ``world_size``-th file (nothing changes outside ``torch.distributed``, without
    ``DistributeOptions(rank=..., world_size=...)``, or with ``policy="off"``).

    A pipeline that starts from a list of files (``tp.list_files``, ``tp.TFRecordDataset``,
    ``tp.from_webdataset``) is split by file on several ranks without it; ``split_files`` puts the
    split at this point (above ops of your own on the names, say). With ``policy="data"`` the
    elements are split instead and ``split_files`` passes every file. For a plain list of names,
    ``tp.distributed.share_of_files`` is the same split.

    Args:
        files: the file names, the same list on every rank.
        shuffled: say that ``files`` was shuffled with the pipeline seed, so the ranks share one
            (rank 0's is broadcast where the pipeline has none; a pass that cannot share one, in
            a torch DataLoader worker, fails instead of giving ranks overlapping files).

    Raises:
        TypeError: for ``files`` that is not a ``tp.Dataset``, or a ``shuffled`` that is not a bool.
    """
    require_bool("split_files", "shuffled", shuffled)
    if not isinstance(files, Dataset):
        raise TypeError(
            f"split_files: expected a tp.Dataset of file names, got {type(files).__name__}"
        )
    return Dataset(SplitFilesNode(files._node, shuffled))

"""Random access to TFRecord files: an index of record offsets (kept in a sidecar file) and
:class:`TFRecordRecords`, a map-style dataset over every record of a list of files.

``tp.from_dataset(tp.io.TFRecordRecords(paths))`` is then a random-access source: ``shuffle``
over all records needs no buffer of records, a parallel ``map`` after it fetches records inside
its workers (source pushdown), and a checkpoint is an index.

The sidecar is a text file, ``<path>.idx`` by default, with one ``offset length`` line per
record (the offset of its header and its length in the file, framing included): the format of
DALI's ``tfrecord2idx`` and of the ``tfrecord`` package, so their indexes are read as is.
"""

from __future__ import annotations

import bisect
import io
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchpipe.arguments import require_bool
from torchpipe.io import remote
from torchpipe.io.addresses import AddressFormat
from torchpipe.io.files import DataLossError, check_path, open_input
from torchpipe.io.tfrecord_framing import (
    _CRC,
    _HEADER,
    FOOTER_BYTES,
    HEADER_BYTES,
    corrupt,
    masked_crc,
    truncated,
)
from torchpipe.runtime.local_files import ProcessLocalFiles

FRAMING = HEADER_BYTES + FOOTER_BYTES
_SCAN_BUFFER = 64 * 1024


def tfrecord_index(
    path: Any,
    index_path: Any = None,
    *,
    write: bool = True,
    retry: remote.RetryPolicy | None = None,
) -> np.ndarray:
    """The offsets and lengths of the records of an uncompressed TFRecord file.

    Reads the sidecar index if there is one and it fits the file (its records end where the
    file ends); otherwise scans the file's record headers (verifying each length's CRC; the data
    is skipped, not read) and, if ``write``, saves the sidecar for next time (atomically; a
    directory that cannot be written is left alone).

    Args:
        path: the TFRecord file (a local path or a URL).
        index_path: the sidecar (default ``path + ".idx"``).
        write: save a sidecar that was missing or stale.
        retry: how reads of URLs are retried.

    Returns:
        An int64 array of shape ``(records, 2)``: each record's byte offset and its length in
        the file (16 bytes of framing plus its data).

    Raises:
        DataLossError: if a record header is corrupt or the file is truncated.
    """
    path = check_path("tfrecord_index", path)
    index_path = path + ".idx" if index_path is None else check_path("tfrecord_index", index_path)
    require_bool("tfrecord_index", "write", write)
    size = remote.size(path) if remote.is_url(path) else os.path.getsize(remote.local_path(path))
    index = _read_sidecar(index_path)
    if index is not None and _fits(index, size):
        return index
    index = scan_records(path, size, retry)
    if write:
        _write_sidecar(index_path, index)
    return index


def index_until_error(path: str) -> tuple[np.ndarray, DataLossError | None]:
    """The records of a local file as :func:`tfrecord_index` finds them, except that a corrupt or
    truncated record ends the index there: the records before it and its error (None for a sound
    file). A sidecar that fits is read; none is written (the file's directory is the user's: a
    pattern such as ``train-*`` would match a new ``.idx`` file)."""
    size = os.path.getsize(remote.local_path(path))
    index = _read_sidecar(path + ".idx")
    if index is not None and _fits(index, size):
        return index, None
    return scan_until_error(path, size, None)


def _read_sidecar(index_path: str) -> np.ndarray | None:
    try:
        if remote.is_url(index_path):
            fs, inner = remote.filesystem(index_path)
            text = fs.cat_file(inner).decode()
        else:
            with open(remote.local_path(index_path), encoding="ascii") as f:
                text = f.read()
        values = np.array(text.split(), dtype=np.int64)
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # missing or unreadable: build it again
    return values.reshape(-1, 2) if values.size % 2 == 0 else None


def _fits(index: np.ndarray, size: int) -> bool:
    """Whether ``index`` frames the whole file: consecutive records from 0 to ``size``, each one
    between its framing's and the file's length (so that no sum wraps around, and a damaged
    sidecar makes the file be scanned rather than a read of its length be allocated)."""
    if len(index) == 0:
        return size == 0
    if not (
        np.all(index[:, 1] >= FRAMING) and np.all(index[:, 1] <= size) and np.all(index[:, 0] >= 0)
    ):
        return False
    ends = index[:, 0] + index[:, 1]
    return bool(index[0, 0] == 0 and ends[-1] == size and np.array_equal(index[1:, 0], ends[:-1]))


def scan_records(path: str, size: int, retry: remote.RetryPolicy | None) -> np.ndarray:
    """The (offset, length) of every record of the TFRecord file at ``path`` (``size`` bytes),
    read from its start to its end (with ``retry`` for remote paths).

    Raises:
        DataLossError: at a truncated or corrupt record, naming the file and its offset.
    """
    index, error = scan_until_error(path, size, retry)
    if error is not None:
        raise error
    return index


def scan_until_error(
    path: str, size: int, retry: remote.RetryPolicy | None
) -> tuple[np.ndarray, DataLossError | None]:
    """:func:`scan_records`, except that a truncated or corrupt record ends the scan: the records
    before it, and its error (None where the whole file was read)."""
    offsets: list[int] = []
    lengths: list[int] = []
    offset = 0
    error = None
    local = not remote.is_url(path)
    # A local file's headers are read where they are (a buffered read would take most of the file).
    with (
        open(remote.local_path(path), "rb", buffering=0)
        if local
        else open_input(path, _SCAN_BUFFER, retry) as f
    ):
        while offset < size:
            header = os.pread(f.fileno(), HEADER_BYTES, offset) if local else f.read(HEADER_BYTES)
            if len(header) < HEADER_BYTES:
                error = truncated(path, offset, f"{len(header)} of its {HEADER_BYTES} header bytes")
                break
            length, length_crc = _HEADER.unpack(header)
            if masked_crc(header[:8]) != length_crc or offset + FRAMING + length > size:
                error = _bad_header(path, offset, header, size)
                break
            offsets.append(offset)
            lengths.append(FRAMING + length)
            offset += FRAMING + length
            if not local:
                f.seek(length + FOOTER_BYTES, io.SEEK_CUR)
    return np.array([offsets, lengths], dtype=np.int64).T.reshape(-1, 2), error


def _bad_header(path: str, offset: int, header: bytes, size: int) -> DataLossError:
    """The error for a record ``header`` at byte ``offset`` whose length's CRC does not match, or
    whose length runs past the end of the file (``size`` bytes)."""
    length, length_crc = _HEADER.unpack(header)
    if masked_crc(header[:8]) != length_crc:
        return corrupt(path, offset, "the length's CRC does not match")
    return truncated(path, offset, f"{length} bytes long, past the end of the file ({size} bytes)")


def _write_sidecar(index_path: str, index: np.ndarray) -> None:
    text = "".join(f"{offset} {length}\n" for offset, length in index.tolist())
    if remote.is_url(index_path):
        return  # object stores get no sidecar written behind the user's back
    directory = os.path.dirname(os.path.abspath(index_path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".idx-", dir=directory)
    except OSError:
        return  # a read-only directory: the index stays in memory
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, index_path)
    except OSError:
        os.unlink(tmp)  # a full disk: no sidecar, and no half-written one either


class TFRecordRecords:
    """Every record of a list of uncompressed TFRecord files, as a map-style dataset of ``bytes``.

    Record ``i`` counts through the files in order. Indexes come from :func:`tfrecord_index`
    (sidecars are read, or built and saved). Local files are read with ``os.pread`` on
    descriptors opened once per process (safe in forked workers and across threads); URLs with
    one ranged request a record.

    Args:
        paths: a path or URL, or a list of them.
        index_paths: sidecar paths, one a file (default ``<path>.idx``).
        verify: check both CRCs of every record read.
        write_index: save sidecars that were missing or stale.
        retry: how reads of URLs are retried.

    Raises:
        TypeError, ValueError: for bad arguments; DataLossError for a corrupt file.
    """

    def __init__(
        self,
        paths: Any,
        *,
        index_paths: Sequence[Any] | None = None,
        verify: bool = True,
        write_index: bool = True,
        retry: remote.RetryPolicy | None = None,
    ) -> None:
        op = "TFRecordRecords"
        items = [paths] if isinstance(paths, (str, bytes, os.PathLike)) else list(paths)
        self.paths = [check_path(op, p) for p in items]
        if not self.paths:
            raise ValueError(f"{op}: no paths given")
        sidecars = [None] * len(self.paths) if index_paths is None else list(index_paths)
        if len(sidecars) != len(self.paths):
            raise ValueError(f"{op}: {len(sidecars)} index_paths for {len(self.paths)} paths")
        require_bool(op, "verify", verify)
        self.verify = verify
        self.retry = retry
        indexes = [
            tfrecord_index(p, s, write=write_index, retry=retry)
            for p, s in zip(self.paths, sidecars)
        ]
        self._offsets = [index[:, 0] for index in indexes]
        self._lengths = [index[:, 1] for index in indexes]
        self._ends = np.cumsum([len(index) for index in indexes]).tolist()
        self._local = ProcessLocalFiles()

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, i: int) -> bytes:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"TFRecordRecords: index {i} out of range for {n} records")
        i = int(i) % n
        file = bisect.bisect_right(self._ends, i)
        k = i - (self._ends[file - 1] if file else 0)
        return self._read(file, int(self._offsets[file][k]), int(self._lengths[file][k]))

    def _read(self, file: int, offset: int, length: int) -> bytes:
        path = self.paths[file]
        if remote.is_url(path):
            framed = remote.read_range(path, offset, length, self.retry)
        else:
            framed = os.pread(self._local.descriptor(file, remote.local_path(path)), length, offset)
        if len(framed) < length:
            raise truncated(
                path,
                offset,
                f"{len(framed)} of its {length} bytes; has the file changed since it was indexed?",
            )
        return unframe(framed, path, offset, self.verify)

    def __repr__(self) -> str:
        return f"TFRecordRecords({len(self.paths)} files, {len(self)} records)"


def unframe(framed: Any, path: str, offset: int, verify: bool) -> bytes:
    """The data of one framed record read whole (``bytes`` or a ``memoryview`` of them); its
    framing is checked against the index.

    Raises:
        DataLossError: where the framing or a CRC does not match, naming the file and offset.
    """
    length, length_crc = _HEADER.unpack_from(framed)
    if length != len(framed) - FRAMING or (verify and masked_crc(framed[:8]) != length_crc):
        raise corrupt(
            path, offset, "its header does not match the index (a stale index, or a damaged length)"
        )
    data = framed[HEADER_BYTES : HEADER_BYTES + length]
    if verify and masked_crc(data) != _CRC.unpack_from(framed, HEADER_BYTES + length)[0]:
        raise corrupt(path, offset, f"the data's CRC does not match ({length} bytes)")
    return data if type(data) is bytes else bytes(data)


class TFRecordAddressFormat(AddressFormat):
    """TFRecord files read by record address (``io/addresses.py``): indexed by
    :func:`index_until_error`, each record checked by :func:`unframe`."""

    kind = "tfrecord_file"

    def __init__(self, verify: bool) -> None:
        self.verify = verify

    def index(self, path: str) -> tuple[np.ndarray, DataLossError | None]:
        return index_until_error(path)

    def record(self, data: memoryview, path: str, offset: int) -> bytes:
        return unframe(data, path, offset, self.verify)

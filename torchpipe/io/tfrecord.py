"""TFRecord files without TensorFlow: ``tp.TFRecordDataset`` and ``tp.io.TFRecordWriter``.

A TFRecord file is a sequence of framed records (``io/tfrecord_framing.py``); a file may be GZIP
or ZLIB compressed as a whole. The CRC32C comes from the ``crc32c`` package: hardware CRC32C
(SSE4.2 / ARMv8) at 15-19 GB/s on 100 KB records, about 3x ``google-crc32c``, and it takes any
buffer and releases the GIL on large ones (docs/formats.md).

A file's reader is a source whose checkpoint is ``{file, offset}``: the byte where the next
record starts (in the uncompressed stream for compressed files), so a resume seeks instead of
reading the records before it again.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from torchpipe.arguments import require_bool, require_int
from torchpipe.constants import AUTOTUNE, UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.dataset import Dataset
from torchpipe.io import remote
from torchpipe.io.addresses import FileAddresses, RecordFetch
from torchpipe.io.files import (
    FileReaderIterator,
    OutputFile,
    check_compression_type,
    check_path,
    open_stream,
    path_dataset,
    read_each,
)
from torchpipe.io.index import TFRecordAddressFormat
from torchpipe.io.tfrecord_framing import (
    _CRC,
    FOOTER_BYTES,
    HEADER_BYTES,
    frame_header,
    masked_crc,
    read_record,
)
from torchpipe.ops.source_nodes import FileOpener, IndexedFiles


class TFRecordFileNode(Node):
    """The records of one TFRecord file, as ``bytes``."""

    kind = "tfrecord_file"

    def __init__(
        self,
        path: str,
        compression: str | None,
        buffer_size: int | None,
        verify: bool,
        retry: remote.RetryPolicy | None,
    ) -> None:
        super().__init__()
        self.path = path
        self.compression = compression
        self.buffer_size = buffer_size
        self.verify = verify
        self.retry = retry

    def params(self) -> dict[str, Any]:
        return {"path": self.path, "compression_type": self.compression}

    def cardinality(self) -> int:
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return TFRecordFileIterator(self)


class TFRecordFileIterator(FileReaderIterator):
    """Reads one TFRecord file record by record; its state is ``{file, offset, done}``.

    After a corrupt or truncated record it raises :class:`DataLossError` once and then ends,
    so that under ``ignore_errors()`` reading goes on at the next file (as in tf.data).
    """

    def __init__(self, node: TFRecordFileNode) -> None:
        super().__init__(f"tfrecord_file({os.path.basename(node.path)})", node.path)
        self._node = node
        self._read: Any = None
        self._size: int | None = None

    def start(self) -> None:
        if self._done:
            return
        node = self._node
        self._stream = open_stream(
            node.path, node.compression, node.buffer_size, self._offset, node.retry
        )
        self._read = self._stream.read
        if node.compression is None and not remote.is_url(node.path):
            self._size = os.fstat(self._stream.fileno()).st_size

    def read_next(self) -> bytes:
        offset = self._offset
        limit = None if self._size is None else self._size - offset
        record = read_record(self._read, self.path, offset, self._node.verify, limit)
        if record is None:
            raise StopIteration
        self._offset = offset + HEADER_BYTES + len(record) + FOOTER_BYTES
        return record


class TFRecordFileReader(FileOpener):
    """The function ``TFRecordDataset`` maps each file name to: a path to a dataset of records.

    Picklable and stateless, so worker processes can open files too.
    """

    __name__ = "tfrecord_file"

    def __init__(
        self,
        compression: str | None,
        buffer_size: int | None,
        verify: bool,
        retry: remote.RetryPolicy | None,
    ) -> None:
        self.compression = compression
        self.buffer_size = buffer_size
        self.verify = verify
        self.retry = retry

    def __call__(self, path: Any) -> Dataset:
        path = check_path("TFRecordDataset", path)
        return Dataset(
            TFRecordFileNode(path, self.compression, self.buffer_size, self.verify, self.retry)
        )

    def indexed(self, paths: list[str]) -> IndexedFiles | None:
        """Uncompressed local files are read by record address (``io/addresses.py``)."""
        if self.compression is not None or any(remote.is_url(path) for path in paths):
            return None  # a URL's index would read the whole file first
        fmt = TFRecordAddressFormat(self.verify)
        return IndexedFiles(FileAddresses(fmt), RecordFetch(fmt))


def TFRecordDataset(  # noqa: N802 - tf.data's name
    filenames: Any,
    compression_type: str | None = None,
    buffer_size: int | None = None,
    num_parallel_reads: int | None = None,
    *,
    verify: bool = True,
    retry: remote.RetryPolicy | None = None,
) -> Dataset:
    """The records of one or more TFRecord files, each as ``bytes`` (tf.data's signature).

    Args:
        filenames: a path or URL, a list of them, or a ``tp.Dataset`` of them.
        compression_type: ``None`` or ``""`` (none), ``"GZIP"`` or ``"ZLIB"``.
        buffer_size: bytes of read buffer per file (default 256 KB locally, 8 MB for URLs).
        num_parallel_reads: ``None`` reads the files one after another; ``n`` or
            ``tp.AUTOTUNE`` interleaves ``n`` files (one record from each in turn, read ahead in
            parallel), as ``filenames.interleave(..., cycle_length=n, num_parallel_calls=n)``.
        verify: check each record's two CRC32Cs (tf.data always does).
        retry: how reads of URLs are retried (default ``tp.io.RetryPolicy()``).

    Raises:
        TypeError, ValueError: for arguments of the wrong type or value.

    While iterating, a corrupt or truncated record raises ``tp.io.DataLossError`` naming the
    file and the record's byte offset; under ``ignore_errors()`` it is skipped (and counted) and
    reading goes on at the next file.

    On several ranks (docs/distributed.md) a list of files is split by whole file between ranks
    and their torch DataLoader workers, as ``tp.DistributeOptions`` says.
    """
    compression = _check_arguments(compression_type, buffer_size, num_parallel_reads, verify, retry)
    reader = TFRecordFileReader(compression, buffer_size, verify, retry)
    if isinstance(filenames, (str, os.PathLike)) and num_parallel_reads is None:
        return reader(filenames)
    return read_each(path_dataset("TFRecordDataset", filenames), reader, num_parallel_reads)


def _check_arguments(
    compression_type: Any, buffer_size: Any, num_parallel_reads: Any, verify: Any, retry: Any
) -> str | None:
    """``TFRecordDataset``'s compression, checked with its other arguments.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or value.
    """
    compression = check_compression_type("TFRecordDataset", compression_type)
    if buffer_size is not None:
        require_int("TFRecordDataset", "buffer_size", buffer_size, minimum=1)
    if num_parallel_reads is not None and num_parallel_reads != AUTOTUNE:
        require_int("TFRecordDataset", "num_parallel_reads", num_parallel_reads, minimum=1)
    require_bool("TFRecordDataset", "verify", verify)
    if retry is not None and not isinstance(retry, remote.RetryPolicy):
        raise TypeError(
            f"TFRecordDataset: retry must be a tp.io.RetryPolicy, got {type(retry).__name__}"
        )
    return compression


TFRecordDataset.__torchpipe_file_opener__ = TFRecordFileReader(None, None, True, None)  # type: ignore[attr-defined]
"""What ``TFRecordDataset(path)`` is for one file, when an interleave maps file names to it."""


class TFRecordWriter:
    """Writes records to a TFRecord file, byte-identical to ``tf.io.TFRecordWriter``'s.

    Use as a context manager, or call :meth:`close`::

        with tp.io.TFRecordWriter("train-00000.tfrecord") as writer:
            writer.write(record_bytes)

    Unlike TensorFlow's, it writes a local file under a temporary name next to ``path``
    (``<path>.tmp-<pid>-<random>``) and renames it to ``path`` when closed, so a file at ``path``
    is always complete, and one there before stays until then. If a write fails (a full disk),
    the ``with`` block raises, or the writer is dropped unclosed, the temporary file is removed and
    nothing is published. A URL is written through fsspec, whose store publishes it on close.

    Args:
        path: a local path or a URL (through fsspec).
        compression_type: ``None``/``""``, ``"GZIP"`` or ``"ZLIB"`` (zlib at TensorFlow's
            settings: default level, memory level 9).

    Raises:
        ValueError: for an unknown compression type.
        DiskFullError: (writing, flushing, closing) if the disk is full or the file would pass
            ``RLIMIT_FSIZE``, naming the file and the bytes written; the writer is then closed.
    """

    def __init__(self, path: Any, compression_type: str | None = None) -> None:
        compression = check_compression_type("TFRecordWriter", compression_type)
        self.path = check_path("TFRecordWriter", path)
        self._deflate = None
        if compression is not None:
            wbits = 16 + zlib.MAX_WBITS if compression == "GZIP" else zlib.MAX_WBITS
            self._deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, wbits, 9)
        self._file = OutputFile(self.path, f"TFRecordWriter({self.path})")

    def write(self, record: Any) -> None:
        """Append one record (``bytes``, ``bytearray`` or ``memoryview``).

        Raises:
            TypeError: for anything else (a str must be encoded first).
            ValueError: after :meth:`close`, or after a write that failed.
        """
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise TypeError(f"TFRecordWriter.write: expected bytes, got {type(record).__name__}")
        data = memoryview(record).cast("B")
        self._emit(frame_header(len(data)))
        self._emit(data)
        self._emit(_CRC.pack(masked_crc(data)))

    def _emit(self, data: Any) -> None:
        file = self._open_file()
        file.write(data if self._deflate is None else self._deflate.compress(data))

    def _open_file(self) -> OutputFile:
        if self._file.closed:
            raise ValueError(f"TFRecordWriter: {self.path} is closed")
        return self._file

    def flush(self) -> None:
        """Push what was written to the temporary file (a compressed file gets a zlib partial
        flush, as TensorFlow's writer does, so the bytes stay identical to its)."""
        file = self._open_file()
        if self._deflate is not None:
            file.write(self._deflate.flush(zlib.Z_PARTIAL_FLUSH))
        file.flush()

    def close(self) -> None:
        """Finish the compressed stream and publish the file at ``path``; idempotent."""
        if self._file.closed:
            return
        if self._deflate is not None:
            self._file.write(self._deflate.flush(zlib.Z_FINISH))
        self._file.publish()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._file.discard()  # the block did not finish: its file is not complete
        else:
            self.close()

"""TFRecord files read by record address: what the optimizer's record_pushdown pass runs.

An interleave (or ``flat_map``) of ``tp.TFRecordDataset`` over local, uncompressed files, under a
parallel ``map``, is rewritten (``graph/passes/record_pushdown.py``) so that the interleave yields
each record's :class:`RecordAddress` instead of its bytes, in the very order the readers would
have yielded the records, and the map reads the records inside its workers
(:class:`TFRecordFetch`): a batch's records, with the map fused with its batch, in a few
contiguous reads. Nothing but the addresses crosses to the workers, and the consumer's thread
does no per-record reading.

An address iterator keeps the state a reader of the same file keeps (``{file, offset, done}``,
``offset`` being where the next record starts), so a checkpoint taken either way loads either way.
The addresses come from each file's index (``io/index.py``: its sidecar, built once), kept in
memory for the files read last. A corrupt or truncated record header ends a file where it is,
as it ends a reader: the records before it, then its :class:`DataLossError`. A record whose data
is damaged fails where it is read, alone: the records after it are read as usual.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from torchpipe.constants import UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.dataset import Dataset
from torchpipe.errors import CheckpointError, DataLossError
from torchpipe.io import remote
from torchpipe.io.files import FileReaderIterator, check_path
from torchpipe.io.index import index_until_error, unframe
from torchpipe.ops.source_nodes import FileOpener
from torchpipe.runtime.local_files import ProcessLocalFiles

MAX_RUN_BYTES = 16 << 20
"""The most bytes one read of adjacent records takes (a batch's records from one file)."""

_CACHED_FILES = 4096  # the indexes kept in memory, the files read last


class RecordAddress(NamedTuple):
    """Where one record is: its file, the byte its framing starts at, and its framed length."""

    path: str
    offset: int
    length: int


class _FileIndex(NamedTuple):
    offsets: list[int]
    lengths: list[int]
    end: int  # where the indexed records end: the file's size, or the damaged record's offset
    error: DataLossError | None


class _Indexes:
    """The indexes of the files read last, by path, size and modification time (a file written
    again is indexed again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int, int], _FileIndex] = OrderedDict()

    def get(self, path: str) -> _FileIndex:
        info = os.stat(remote.local_path(path))
        key = (path, info.st_size, info.st_mtime_ns)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        index, error = index_until_error(path)
        offsets, lengths = index[:, 0].tolist(), index[:, 1].tolist()
        end = offsets[-1] + lengths[-1] if offsets else 0
        made = _FileIndex(offsets, lengths, end, error)
        with self._lock:
            self._cache[key] = made
            while len(self._cache) > _CACHED_FILES:
                self._cache.popitem(last=False)
        return made


INDEXES = _Indexes()
"""This process's indexes of the files read by address."""


class TFRecordAddressNode(Node):
    """The addresses of the records of one TFRecord file, in order."""

    kind = "tfrecord_file"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def params(self) -> dict[str, Any]:
        return {"path": self.path}

    def cardinality(self) -> int:
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return TFRecordAddressIterator(self.path)


class TFRecordAddressIterator(FileReaderIterator):
    """Yields a file's :class:`RecordAddress` es from its index; its state is a reader's."""

    def __init__(self, path: str) -> None:
        super().__init__(f"tfrecord_file({os.path.basename(path)})", path)
        self._index = _FileIndex([], [], 0, None)
        self._next = 0

    def start(self) -> None:
        if self._done:
            return
        index = self._index = INDEXES.get(self.path)
        k = bisect.bisect_left(index.offsets, self._offset)
        at_record = k < len(index.offsets) and index.offsets[k] == self._offset
        if not at_record and self._offset != index.end:
            raise CheckpointError(f"{self.name}: no record of {self.path} starts at byte {self._offset}, where the "
                                  "checkpoint reads on: has the file changed since?")  # fmt: skip
        self._next = k

    def read_next(self) -> RecordAddress:
        index, k = self._index, self._next
        if k < len(index.offsets):
            self._next = k + 1
            offset, length = index.offsets[k], index.lengths[k]
            self._offset = offset + length
            return RecordAddress(self.path, offset, length)
        if index.error is not None:  # a fresh one: a raised error gathers notes
            raise DataLossError(index.error.args[0], index.error.path, index.error.offset)
        raise StopIteration


class TFRecordAddresses(FileOpener):
    """What record_pushdown maps each file name to: the dataset of its records' addresses."""

    __name__ = "tfrecord_file"

    def __call__(self, path: Any) -> Dataset:
        return Dataset(TFRecordAddressNode(check_path("TFRecordDataset", path)))


class TFRecordFetch:
    """Records by :class:`RecordAddress`, as a map-style dataset gives elements by index.

    ``__getitems__`` reads a batch's records with one ``os.pread`` per run of adjacent records
    in a file (up to ``MAX_RUN_BYTES``); descriptors are opened once per process (forked workers
    open their own). Each record's framing and (with ``verify``) CRCs are checked.

    Raises:
        DataLossError: for a record that is damaged or shorter than its address says, naming
            the file and the record's offset.
    """

    torchpipe_stage = "tfrecord_file"

    def __init__(self, verify: bool) -> None:
        self.verify = verify
        self._local = ProcessLocalFiles()
        self._keys: dict[str, int] = {}

    def __getitem__(self, address: RecordAddress) -> bytes:
        return self.__getitems__([address])[0]

    def __getitems__(self, addresses: list[RecordAddress]) -> list[bytes]:
        records: list[Any] = [None] * len(addresses)
        order = sorted(range(len(addresses)), key=addresses.__getitem__)
        run: list[int] = []
        for j in order:
            if run:
                path, start, _ = addresses[run[0]]
                last = addresses[run[-1]]
                address = addresses[j]
                adjacent = address.path == path and address.offset == last.offset + last.length
                if not adjacent or address.offset + address.length - start > MAX_RUN_BYTES:
                    self._read_run(addresses, run, records)
                    run = []
            run.append(j)
        if run:
            self._read_run(addresses, run, records)
        return records

    def _read_run(self, addresses: list[RecordAddress], run: list[int], records: list[Any]) -> None:
        path, start, _ = addresses[run[0]]
        last = addresses[run[-1]]
        size = last.offset + last.length - start
        key = self._keys.setdefault(path, len(self._keys))
        data = memoryview(os.pread(self._local.descriptor(key, remote.local_path(path)), size, start))
        for j in run:
            _, offset, length = addresses[j]
            framed = data[offset - start : offset - start + length]
            if len(framed) < length:
                raise DataLossError(f"{path}: truncated record at byte {offset}: {len(framed)} of its {length} "
                                    "bytes; has the file changed since it was indexed?", path, offset)  # fmt: skip
            records[j] = unframe(framed, path, offset, self.verify)

    def __repr__(self) -> str:
        return f"TFRecordFetch(verify={self.verify})"

"""Record files read by address: what the optimizer's record_pushdown pass runs.

An interleave (or ``flat_map``) of a file reader (``tp.TFRecordDataset``, ``from_webdataset``'s
shards) over local, uncompressed files, under a parallel ``map``, is rewritten
(``graph/passes/record_pushdown.py``) so that the interleave yields each record's
:class:`RecordAddress` instead of the record, in the very order the readers would have yielded
them, and the map reads the records inside its workers (:class:`RecordFetch`): a batch's records,
with the map fused with its batch, in a few contiguous reads. Nothing but the addresses crosses to
the workers, and the consumer's thread reads no record.

A file format says how (:class:`AddressFormat`): how a file is indexed (a TFRecord file's record
offsets, a tar shard's sample ranges) and how one record is made from its bytes. An address
iterator keeps the state a reader of the same file keeps (``{file, offset, done}``, ``offset``
being where the next record starts), so a checkpoint taken either way loads either way. Indexes
are read once in each process (no file is written) and kept in memory for the files read last.
A damaged file is indexed up to the damage, as far as its reader would read, then gives the
reader's :class:`DataLossError`; a record whose own bytes are damaged fails where it is read,
alone: the records after it are read as usual.
"""

from __future__ import annotations

import abc
import bisect
import os
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from torchpipe.constants import UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.dataset import Dataset
from torchpipe.errors import CheckpointError, DataLossError
from torchpipe.io import remote
from torchpipe.io.files import FileReaderIterator, check_path
from torchpipe.ops.source_nodes import FileOpener
from torchpipe.runtime.forks import ForkSafeLock
from torchpipe.runtime.local_files import ProcessLocalFiles

MAX_RUN_BYTES = 16 << 20
"""The most bytes one read of adjacent records takes (a batch's records from one file)."""

_CACHED_FILES = 4096  # the indexes kept in memory, the files read last


class RecordAddress(NamedTuple):
    """Where one record is: its file, the byte it starts at, and its length in the file."""

    path: str
    offset: int
    length: int


class AddressFormat(abc.ABC):
    """How the files of one format are read by address. Picklable (a map's workers get it)."""

    kind: str
    """The reader's op kind (``tfrecord_file``, ``tar_shard``): the address iterators' name."""

    last_is_done: bool = False
    """Whether the reader's state after the file's last record is already ``done`` (a tar
    shard's reader ends at the last sample; a TFRecord reader only when asked for another)."""

    @abc.abstractmethod
    def index(self, path: str) -> tuple[np.ndarray, DataLossError | None]:
        """``(offset, length)`` rows of the records of local file ``path``, in file order, as far
        as its reader would read them, and the reader's error where it would stop early."""

    @abc.abstractmethod
    def record(self, data: memoryview, path: str, offset: int) -> Any:
        """The record read whole as ``data`` (at ``offset`` of ``path``), as the reader gives it.

        Raises:
            DataLossError: where its bytes are damaged, naming the file and offset.
        """


class _FileIndex(NamedTuple):
    offsets: list[int]
    lengths: list[int]
    end: int  # where the indexed records end: the file's size, or where its reader stops
    error: DataLossError | None


class _Indexes:
    """The indexes of the files read last, by format, path, size and modification time (a file
    written again is indexed again)."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()  # a worker forked mid-lookup looks up on
        self._cache: OrderedDict[tuple[str, str, int, int], _FileIndex] = OrderedDict()

    def get(self, fmt: AddressFormat, path: str) -> _FileIndex:
        info = os.stat(remote.local_path(path))
        key = (fmt.kind, path, info.st_size, info.st_mtime_ns)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        index, error = fmt.index(path)
        offsets, lengths = index[:, 0].tolist(), index[:, 1].tolist()
        made = _FileIndex(offsets, lengths, offsets[-1] + lengths[-1] if offsets else 0, error)
        with self._lock:
            self._cache[key] = made
            while len(self._cache) > _CACHED_FILES:
                self._cache.popitem(last=False)
        return made

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


INDEXES = _Indexes()
"""This process's indexes of the files read by address."""


class AddressNode(Node):
    """The addresses of the records of one file, in order."""

    kind = "record_addresses"

    def __init__(self, path: str, fmt: AddressFormat) -> None:
        super().__init__()
        self.path = path
        self.format = fmt

    def params(self) -> dict[str, Any]:
        return {"path": self.path}

    def cardinality(self) -> int:
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return AddressIterator(self.path, self.format)


class AddressIterator(FileReaderIterator):
    """Yields a file's :class:`RecordAddress` es from its index; its state is its reader's."""

    def __init__(self, path: str, fmt: AddressFormat) -> None:
        super().__init__(f"{fmt.kind}({path.rsplit('/', 1)[-1]})", path)
        self._format = fmt
        self._index = _FileIndex([], [], 0, None)
        self._next = 0

    def start(self) -> None:
        if self._done:
            return
        index = self._index = INDEXES.get(self._format, self.path)
        k = bisect.bisect_left(index.offsets, self._offset)
        at_record = k < len(index.offsets) and index.offsets[k] == self._offset
        if not at_record and self._offset not in (
            0,
            index.end,
        ):  # 0: the file's start, what precedes its first
            raise CheckpointError(
                f"{self.name}: no record of {self.path} starts at byte {self._offset}, where the "
                "checkpoint reads on: has the file changed since?"
            )
        self._next = k

    def read_next(self) -> RecordAddress:
        index, k = self._index, self._next
        if k < len(index.offsets):
            self._next = k + 1
            offset, length = index.offsets[k], index.lengths[k]
            self._offset = offset + length
            if self._format.last_is_done and k + 1 == len(index.offsets) and index.error is None:
                self._done = True
            return RecordAddress(self.path, offset, length)
        if index.error is not None:  # a fresh one: a raised error gathers notes
            raise DataLossError(index.error.args[0], index.error.path, index.error.offset)
        raise StopIteration


class FileAddresses(FileOpener):
    """What record_pushdown maps each file name to: the dataset of its records' addresses."""

    def __init__(self, fmt: AddressFormat) -> None:
        self.format = fmt
        self.__name__ = fmt.kind

    def __call__(self, path: Any) -> Dataset:
        return Dataset(AddressNode(check_path(self.format.kind, path), self.format))


class RecordFetch:
    """Records by :class:`RecordAddress`, as a map-style dataset gives elements by index.

    ``__getitems__`` reads a batch's records with one ``os.pread`` per run of adjacent records
    in a file (up to ``MAX_RUN_BYTES``); descriptors are opened once per process (forked workers
    open their own). Each record is made by the format (its framing and checksums checked).

    Raises:
        DataLossError: for a record that is damaged or shorter than its address says, naming
            the file and the record's offset.
    """

    def __init__(self, fmt: AddressFormat) -> None:
        self.format = fmt
        self.torchpipe_stage = fmt.kind  # what an error's note names
        self._local = ProcessLocalFiles()
        self._keys: dict[str, int] = {}

    def __getitem__(self, address: RecordAddress) -> Any:
        return self.__getitems__([address])[0]

    def __getitems__(self, addresses: list[RecordAddress]) -> list[Any]:
        records: list[Any] = [None] * len(addresses)
        run: list[int] = []
        for j in sorted(range(len(addresses)), key=addresses.__getitem__):
            if run:
                path, start, _ = addresses[run[0]]
                last, address = addresses[run[-1]], addresses[j]
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
        key = self._keys.setdefault(path, len(self._keys))
        fd = self._local.descriptor(key, remote.local_path(path))
        data = memoryview(os.pread(fd, last.offset + last.length - start, start))
        for j in run:
            _, offset, length = addresses[j]
            piece = data[offset - start : offset - start + length]
            if len(piece) < length:
                raise DataLossError(
                    f"{path}: truncated record at byte {offset}: {len(piece)} of its {length} "
                    "bytes; has the file changed since it was indexed?",
                    path,
                    offset,
                )
            records[j] = self.format.record(piece, path, offset)

    def __repr__(self) -> str:
        return f"RecordFetch({type(self.format).__name__})"

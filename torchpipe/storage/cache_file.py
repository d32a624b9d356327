"""The file behind ``cache(path)``: its format, the writer that publishes it, the reader.

File format, version 3 (the full description is in ``docs/cache.md``); integers little-endian::

    header   magic b"TPCACHE\\0" (8) | version u32 | meta length u32 | meta (UTF-8 JSON)
    record   payload length u64 | record index u64 | CRC-32 of index and payload u32 | payload
    footer   record count u64 | record bytes u64 | magic b"TPCEND\\0\\0" (8)

The meta holds the origin of the pass that filled the file and the fingerprint of the pipeline
above the cache (``storage/fingerprint.py``, functions by their code). Each record carries its index,
covered by its checksum, so records in the wrong place are an error, not a silent reorder. A
payload is one element in the format of :mod:`torchpipe.runtime.codec.records`.

A filling pass writes ``<path>.tmp-<pid>-<random>`` next to ``path`` under an exclusive ``flock``
and publishes it at ``path`` only after the footer is on disk, so a file at ``path`` is always
complete. Once a complete file is there, temporary files that no writer holds locked (left by
killed processes) are removed. A pass that runs out of room (a full disk, or ``RLIMIT_FSIZE``)
raises :class:`~torchpipe.errors.DiskFullError` naming the file and the bytes written, removes its
temporary file and stores nothing; the next pass fills the file again. A file written by another
pipeline or an older torchpipe is not replayed: the pass warns, fills, and its file replaces the
stale one. Reading unpickles with torchpipe's restricted unpickler
(:mod:`torchpipe.runtime.codec.restricted`), so a file planted at ``path`` runs no code, unless the
cache was made with ``trusted=True``.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import warnings
import weakref
import zlib
from typing import Any, BinaryIO

from torchpipe.errors import UntrustedTypeError, add_note
from torchpipe.observe.progress import ProgressBar
from torchpipe.runtime import codec
from torchpipe.runtime.codec.restricted import SafeGlobals
from torchpipe.storage.pending_file import PendingFile, open_no_follow

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; a resumed fill then trusts the checkpoint alone
    fcntl = None  # type: ignore[assignment]

MAGIC = b"TPCACHE\0"
END_MAGIC = b"TPCEND\0\0"
VERSION = 3
_HEADER = struct.Struct("<8sII")
RECORD = struct.Struct("<QQI")
"""A record's framing: payload length, record index, CRC-32 of the index's 8 bytes and the payload."""
_INDEX = struct.Struct("<Q")
FOOTER = struct.Struct("<QQ8s")
"""The footer: record count, record bytes, ``END_MAGIC``."""
_IO_BUFFER = 1 << 20

Origin = tuple[int, int, tuple[int, ...]]
"""(seed, epoch, repetition counters) of the pass that fills a cache; a replay needs them to
rebuild exactly that pass when the stored elements are gone."""


class CacheFormatError(ValueError):
    """A cache file is truncated, corrupt, or not a torchpipe cache file."""


class StaleCacheWarning(UserWarning):
    """A cache file was written by another pipeline or an older torchpipe; this pass rebuilds it."""


def origin_of(value: Any) -> Origin:
    """An origin from its saved form ``[seed, epoch, [repetition, ...]]``."""
    seed, epoch, iteration = value
    return int(seed), int(epoch), tuple(int(i) for i in iteration)


def file_header(origin: Origin, upstream: list[str]) -> bytes:
    meta = json.dumps(
        {"origin": [origin[0], origin[1], list(origin[2])], "pipeline": upstream}
    ).encode()
    return _HEADER.pack(MAGIC, VERSION, len(meta)) + meta


def read_header(file: BinaryIO, path: str) -> tuple[int, int, dict[str, Any]]:
    """``(version, records start offset, meta)`` of an open cache file; only the version is
    checked for files of another version."""
    fixed = file.read(_HEADER.size)
    if len(fixed) < _HEADER.size:
        raise CacheFormatError(f"cache file {path!r} is truncated (no complete header)")
    magic, version, meta_len = _HEADER.unpack(fixed)
    if magic != MAGIC:
        raise CacheFormatError(f"{path!r} is not a torchpipe cache file (bad magic {magic!r})")
    if version > VERSION:
        raise CacheFormatError(
            f"cache file {path!r} has format version {version}, from a newer torchpipe"
        )
    if version < VERSION:
        return version, _HEADER.size + meta_len, {}
    try:
        meta = json.loads(file.read(meta_len).decode())
        origin_of(meta["origin"])
        if not isinstance(meta["pipeline"], list):
            raise TypeError("pipeline")
    except (ValueError, KeyError, TypeError) as e:
        raise CacheFormatError(f"cache file {path!r} has a corrupt header") from e
    return version, _HEADER.size + meta_len, meta


def record_crc(index: int, payload: bytes) -> int:
    """The CRC-32 a record carries: of its index's 8 bytes followed by its payload."""
    return zlib.crc32(payload, zlib.crc32(_INDEX.pack(index)))


def frame_record(index: int, payload: bytes) -> bytes:
    """The framing written before ``payload`` as record ``index``."""
    return RECORD.pack(len(payload), index, record_crc(index, payload))


def _is_current(path: str, upstream: list[str]) -> bool:
    """Whether the file at ``path`` is this version's and was written by the pipeline ``upstream``."""
    try:
        with open(path, "rb") as file:
            version, _, meta = read_header(file, path)
    except (OSError, CacheFormatError):
        return False
    return version == VERSION and meta["pipeline"] == upstream


def _remove_temp(pending: PendingFile, bar: ProgressBar) -> None:
    bar.close()
    pending.discard()


def try_lock(file: BinaryIO) -> bool:
    """Take an exclusive advisory lock (never waits); False if another writer holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def remove_stale_temps(path: str) -> None:
    """Remove the temporary files of killed passes that filled ``path``: those no writer holds
    locked. Only once a complete file is at ``path``: until then a resumed fill may use one.
    Without ``flock`` (Windows) nothing is removed: a live writer could not be told apart."""
    if fcntl is None:
        return
    for temp in glob.glob(glob.escape(path) + ".tmp-*"):
        try:
            with open(temp, "rb") as file:
                if try_lock(file):
                    os.remove(temp)
        except OSError:  # gone already, or not ours to remove
            continue


class CacheWriter:
    """Appends records to a temporary file and publishes it at ``path`` when complete.

    The temporary file is removed if the writer is discarded or garbage collected first.

    Raises:
        DiskFullError: (adding, taking a checkpoint, committing) if the disk is full; the caller
            then discards the writer.
    """

    TEMP, OFFSET, WRITTEN = "temp", "offset", "written"

    def __init__(
        self,
        pending: PendingFile,
        start: int,
        offset: int,
        count: int,
        upstream: list[str],
        total: int | None = None,
    ) -> None:
        self.path, self.temp = pending.path, pending.temp
        self._pending = pending
        self._start = start  # offset of the first record
        self.offset = offset
        self.count = count
        self._upstream = upstream
        self.bar = ProgressBar(pending.stage, total, initial=count)  # drawn on a terminal only
        self._finalizer = weakref.finalize(self, _remove_temp, pending, self.bar)

    @classmethod
    def create(
        cls, path: str, origin: Origin, upstream: list[str], total: int | None = None
    ) -> CacheWriter:
        """A writer of a new temporary file next to ``path``.

        Raises:
            FileNotFoundError: if ``path``'s directory does not exist.
            PermissionError: if it is not writable.
            DiskFullError: if the disk is full.
        """
        try:
            pending = PendingFile.create(path, f"cache({path})", buffering=_IO_BUFFER)
        except FileNotFoundError as e:
            folder = os.path.dirname(os.path.abspath(path))
            raise FileNotFoundError(
                f"cannot write cache file {path!r}: directory {folder!r} does not exist"
            ) from e
        except PermissionError as e:
            folder = os.path.dirname(os.path.abspath(path))
            raise PermissionError(
                f"cannot write cache file {path!r}: directory {folder!r} is not writable"
            ) from e
        try_lock(pending.file)
        header = file_header(origin, upstream)
        # from here on, it removes its file
        writer = cls(pending, len(header), len(header), 0, upstream, total)
        pending.write(header)
        return writer

    @classmethod
    def resume(
        cls, path: str, state: dict[str, Any], upstream: list[str], total: int | None = None
    ) -> CacheWriter | None:
        """Reopen an interrupted pass's temporary file at its checkpoint, or None if unusable."""
        if not isinstance(state[cls.TEMP], str):
            return None
        temp, offset, count = state[cls.TEMP], int(state[cls.OFFSET]), int(state[cls.WRITTEN])
        try:
            file = open_no_follow(temp, "r+b", buffering=_IO_BUFFER)  # owned by the writer
        except OSError:
            return None
        try:
            version, start, meta = read_header(file, temp)
            usable = (
                version == VERSION
                and meta["pipeline"] == upstream
                and start <= offset <= os.fstat(file.fileno()).st_size
                and try_lock(file)
            )
        except CacheFormatError:
            usable = False
        if not usable:
            file.close()
            return None
        file.truncate(offset)
        file.seek(offset)
        return cls(
            PendingFile(file, temp, path, f"cache({path})", offset),
            start,
            offset,
            count,
            upstream,
            total,
        )

    def add(self, element: Any) -> None:
        payload = codec.encode_bytes(element)
        index = self.count
        self._pending.write(frame_record(index, payload))
        self._pending.write(payload)
        self.offset += RECORD.size + len(payload)
        self.count += 1
        self.bar.update()

    def state(self) -> dict[str, Any]:
        # Flushed so that a process killed after this checkpoint can still resume the file.
        self._pending.flush(sync=False)
        return {self.TEMP: self.temp, self.OFFSET: self.offset, self.WRITTEN: self.count}

    def commit(self) -> None:
        """Write the footer and publish the file at ``path``, unless a current one is there
        (the first complete pass wins); a stale one (another pipeline's) is replaced."""
        self._pending.write(FOOTER.pack(self.count, self.offset - self._start, END_MAGIC))
        self._pending.close(sync=True)
        try:
            os.link(self.temp, self.path)  # never overwrites a current file
        except FileExistsError:
            if not _is_current(self.path, self._upstream):
                os.replace(self.temp, self.path)
        except OSError:  # a filesystem without hard links
            if not _is_current(self.path, self._upstream):
                os.replace(self.temp, self.path)
        self._finalizer()
        remove_stale_temps(self.path)

    def discard(self) -> None:
        self._finalizer()


class CacheReader:
    """Reads the records of a complete cache file in order; its position survives a checkpoint.

    Attributes:
        version: the file's format version; a file of an older one is not read (``meta`` is
            empty and reading raises).
        origin: the pass that filled it; upstream: the fingerprint of the pipeline above it.

    Args:
        path: the file.
        trusted: unpickle records with full pickle (which runs any code they hold), not with the
            restricted unpickler.

    Raises:
        CacheFormatError: (on open or while reading) for a truncated or corrupt file.
        UntrustedTypeError: (reading) if a record holds a type outside the allow-list.
    """

    POSITION, OFFSET = "position", "offset"

    def __init__(self, path: str, trusted: bool = False) -> None:
        self.path = path
        self.trusted = trusted
        self._file: BinaryIO = open(path, "rb", buffering=_IO_BUFFER)  # noqa: SIM115
        try:
            self.version, self._start, meta = read_header(self._file, path)
            self.origin = origin_of(meta["origin"]) if meta else (0, 0, ())
            self.upstream: list[str] = meta.get("pipeline", [])
            self.count, self._end = self._read_footer() if meta else (0, self._start)
        except BaseException:
            self._file.close()
            raise
        self.position = 0
        self.offset = self._start

    def _read_footer(self) -> tuple[int, int]:
        size = os.fstat(self._file.fileno()).st_size
        if size < self._start + FOOTER.size:
            raise CacheFormatError(f"cache file {self.path!r} is truncated (no footer)")
        self._file.seek(size - FOOTER.size)
        count, data_bytes, magic = FOOTER.unpack(self._file.read(FOOTER.size))
        if magic != END_MAGIC or self._start + data_bytes + FOOTER.size != size:
            raise CacheFormatError(f"cache file {self.path!r} is truncated or corrupt (bad footer)")
        self._file.seek(self._start)
        return count, self._start + data_bytes

    def seek(self, position: int, offset: int) -> bool:
        """Continue at record ``position`` found at byte ``offset``; False if out of range."""
        if not (0 <= position <= self.count and self._start <= offset <= self._end):
            return False
        self._file.seek(offset)
        self.position, self.offset = position, offset
        return True

    def next(self) -> Any:
        if self.position >= self.count:
            if self.version < VERSION:  # its records are not in this version's format
                old = f"format version {self.version}, from an older torchpipe"
                raise CacheFormatError(f"cache file {self.path!r} has {old}; it is not read")
            if self.offset != self._end:
                raise self._fail("has data after its last record")
            raise StopIteration
        fixed = self._file.read(RECORD.size)
        length, index, crc = RECORD.unpack(fixed) if len(fixed) == RECORD.size else (-1, 0, 0)
        if length < 0 or self.offset + RECORD.size + length > self._end:
            raise self._fail(f"record {self.position} runs past the data")
        payload = self._file.read(length)
        if record_crc(index, payload) != crc:
            raise self._fail(f"record {self.position} fails its checksum")
        if index != self.position:
            raise self._fail(
                f"record {index} is where record {self.position} belongs (records out of order)"
            )
        try:
            element = codec.decode_bytes(payload, restricted=not self.trusted)
        except UntrustedTypeError as e:
            add_note(e, f"reading record {self.position} of the cache file {self.path!r}")
            raise
        except Exception as e:
            raise self._fail(f"record {self.position} cannot be read") from e
        self.position += 1
        self.offset += RECORD.size + length
        return element

    def _fail(self, problem: str) -> CacheFormatError:
        # Nothing after a damaged record can be trusted: the pass ends after this error.
        self.position, self.offset = self.count, self._end
        return CacheFormatError(f"cache file {self.path!r} is damaged: {problem}")

    def state(self) -> dict[str, Any]:
        return {self.POSITION: self.position, self.OFFSET: self.offset}

    def close(self) -> None:
        self._file.close()


class FileStorage:
    """A node's cache file: replays read it, recorders write a temporary file and publish it.

    Args:
        path: the file.
        upstream: the fingerprint of the pipeline above the cache; a file written by another
            is stale.
        total: the input's cardinality, for the progress bar.
        trusted: read records with full pickle (see :class:`CacheReader`).
    """

    def __init__(
        self, path: str, upstream: list[str], total: int | None = None, trusted: bool = False
    ) -> None:
        self.path = path
        self.upstream = upstream
        self.total = total
        self.trusted = trusted
        # pickled with the storage, it allows in workers what is allowed here
        self._safe_globals = SafeGlobals()

    def replay(self, origin: Origin | None, state: dict[str, Any] | None) -> CacheReader | None:
        """A reader of the file at ``state``'s position (if it was filled by ``origin``'s pass),
        or None: no file, another pass's, or a stale one (with a :class:`StaleCacheWarning`)."""
        if os.path.isdir(self.path):
            raise IsADirectoryError(
                f"cache path {self.path!r} is a directory; expected a file name"
            )
        try:
            reader = CacheReader(self.path, self.trusted)
        except FileNotFoundError:
            return None
        stale = self._staleness(reader)
        usable = stale is None and (origin is None or reader.origin == origin)
        if usable and state is not None:
            usable = reader.seek(int(state[CacheReader.POSITION]), int(state[CacheReader.OFFSET]))
        if not usable:
            reader.close()
            if stale is not None:
                warnings.warn(
                    f"{stale}; this pass rebuilds it and replaces it when it completes",
                    StaleCacheWarning,
                    stacklevel=2,
                )
            return None
        remove_stale_temps(self.path)
        return reader

    def _staleness(self, reader: CacheReader) -> str | None:
        if reader.version < VERSION:
            return f"cache file {self.path!r} has format version {reader.version}, from an older torchpipe"
        if reader.upstream == self.upstream:
            return None
        saved, mine = reader.upstream, self.upstream
        changes = [
            f"op {i} was {old}, now {new}"
            for i, (old, new) in enumerate(zip(saved, mine))
            if old != new
        ]
        if len(saved) != len(mine) or not changes:
            changes = [f"ops {saved} vs {mine}"]
        return f"cache file {self.path!r} was written by another pipeline above the cache: {'; '.join(changes)}"

    def recorder(self, origin: Origin) -> CacheWriter:
        return CacheWriter.create(self.path, origin, self.upstream, self.total)

    def resume_recorder(self, state: dict[str, Any]) -> CacheWriter | None:
        return CacheWriter.resume(self.path, state, self.upstream, self.total)

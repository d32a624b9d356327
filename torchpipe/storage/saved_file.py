"""Saved datasets on disk: a directory of checksummed shards and a manifest.

``ds.save(path)``, ``tp.load(path)`` and ``ds.snapshot(path)`` share this format (the full
description is in ``docs/save.md``)::

    manifest.json                    written last, atomically; without it the directory holds no dataset
    shard-<gen>-00000.records        a cache file (storage/cache_file.py, format 3) whose record index is
                                     the element's index in the dataset, not its place in the shard
    shard-<gen>-00000.index          per record: element index, byte offset, framed length (u64 LE)
    .lock                            held (flock) by the one process writing the directory

A shard is written as ``<name>.partial`` files and renamed when its footer is on disk; the manifest
names the files of one generation ``<gen>`` (8 hex digits), so a reader sees a complete dataset or
none. Files are written through :class:`~torchpipe.storage.pending_file.PendingFile`, so a full disk
raises :class:`~torchpipe.errors.DiskFullError` naming the file and the bytes written. Each shard
file is opened for reading once per process and read with ``os.pread``: a record is one read,
checked against its CRC and its index before it is decoded.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
import zlib
from typing import Any, BinaryIO

import numpy as np

from torchpipe.errors import DataLossError, UntrustedTypeError, add_note
from torchpipe.runtime import codec
from torchpipe.runtime.codec.restricted import SafeGlobals
from torchpipe.runtime.local_files import ProcessLocalFiles
from torchpipe.storage.cache_file import (
    END_MAGIC,
    FOOTER,
    RECORD,
    VERSION,
    Origin,
    file_header,
    frame_record,
    origin_of,
    read_header,
    record_crc,
    try_lock,
)
from torchpipe.storage.pending_file import (
    PendingFile,
    create_exclusive,
    open_no_follow,
    reporting_full_disk,
    write_file,
)

FORMAT = "torchpipe-saved"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK = ".lock"
PARTIAL = ".partial"
COMPRESSIONS = (None, "GZIP", "ZLIB")
ENTRY = struct.Struct("<QQQ")
"""An index entry: the element's index, the record's byte offset and its framed length."""
_IO_BUFFER = 1 << 20


class SavedFormatError(ValueError):
    """A directory holds no saved dataset, or one that is damaged or from a newer torchpipe."""


def new_generation() -> str:
    """A fresh generation name: the files of one save carry it."""
    return secrets.token_hex(4)


def shard_name(generation: str, shard: int) -> str:
    return f"shard-{generation}-{shard:05d}"


# -- compression -----------------------------------------------------------------------------------
def check_compression(compression: Any) -> str | None:
    """``compression`` if supported; ``"gzip"`` is taken for ``"GZIP"``.

    Raises:
        ValueError: naming the supported ones.
    """
    value = compression.upper() if isinstance(compression, str) else compression
    if value not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
    return value


def compress(payload: bytes, compression: str | None) -> bytes:
    """``payload`` compressed record by record, so a record stays one random read."""
    if compression is None:
        return payload
    packer = zlib.compressobj(6, zlib.DEFLATED, 31 if compression == "GZIP" else 15)
    return packer.compress(payload) + packer.flush()


def decompress(payload: bytes, compression: str | None) -> bytes:
    if compression is None:
        return payload
    return zlib.decompress(payload, 31 if compression == "GZIP" else 15)


# -- writing one shard -----------------------------------------------------------------------------
def _create_partial(base: str, suffix: str, stage: str) -> PendingFile:
    """A new ``<base><suffix>.partial``, to be published as ``<base><suffix>``."""
    temp = base + suffix + PARTIAL
    with contextlib.suppress(FileNotFoundError):
        os.remove(temp)  # a killed save's (a symlink is removed, never followed)
    with reporting_full_disk(stage, temp, lambda: 0):
        file = create_exclusive(temp, buffering=_IO_BUFFER)
    return PendingFile(file, temp, base + suffix, stage)


def _resumable_start(
    records: BinaryIO,
    index: BinaryIO,
    base: str,
    name: str,
    offset: int,
    count: int,
    pipeline: list[str],
) -> int:
    """Where the records of the partial shard ``name`` (at ``base``) start, if its ``records``
    and ``index`` files hold ``offset`` bytes and ``count`` entries at least, written by
    ``pipeline``.

    Raises:
        SavedFormatError: otherwise (both files closed).
    """
    try:
        version, start, meta = read_header(records, base)
        usable = (
            version == VERSION
            and meta["pipeline"] == pipeline
            and start <= offset <= os.fstat(records.fileno()).st_size
            and count * ENTRY.size <= os.fstat(index.fileno()).st_size
        )
    except (ValueError, KeyError) as e:
        records.close(), index.close()
        raise SavedFormatError(f"cannot resume shard {name}: {e}") from e
    if not usable:
        records.close(), index.close()
        raise SavedFormatError(
            f"cannot resume shard {name}: its files are shorter than the checkpoint or "
            "were written by another pipeline"
        )
    return start


class ShardFile:
    """One shard being written: its records file and its index, both ``.partial`` until finished.

    Attributes:
        offset: the records file's length so far; count: the records written.

    Raises:
        DiskFullError: (writing, flushing, finishing) if the disk is full, naming the file.
    """

    def __init__(
        self,
        directory: str,
        name: str,
        records: PendingFile,
        index: PendingFile,
        start: int,
        offset: int,
        count: int,
    ) -> None:
        self.directory, self.name = directory, name
        self._records, self._index = records, index
        self._start = start
        self.offset, self.count = offset, count

    @classmethod
    def create(
        cls, directory: str, name: str, origin: Origin, pipeline: list[str], stage: str = "save"
    ) -> ShardFile:
        """A new shard ``name`` in ``directory`` (partial files replaced if there); ``stage``
        names the writer in errors."""
        base = os.path.join(directory, name)
        records = _create_partial(base, ".records", stage)
        try:
            index = _create_partial(base, ".index", stage)
            header = file_header(origin, pipeline)
            records.write(header)
        except BaseException:
            records.abort()
            raise
        return cls(directory, name, records, index, len(header), len(header), 0)

    @classmethod
    def resume(
        cls,
        directory: str,
        name: str,
        offset: int,
        count: int,
        pipeline: list[str],
        stage: str = "save",
    ) -> ShardFile:
        """The partial shard ``name`` cut back to ``offset`` bytes and ``count`` records (a checkpoint).

        Raises:
            SavedFormatError: if its files are missing, shorter than the checkpoint, or another
                pipeline's.
        """
        base = os.path.join(directory, name)
        try:
            records = open_no_follow(base + ".records" + PARTIAL, "r+b", buffering=_IO_BUFFER)
            index = open_no_follow(base + ".index" + PARTIAL, "r+b", buffering=_IO_BUFFER)
        except OSError as e:
            raise SavedFormatError(f"cannot resume shard {name}: {e}") from e
        start = _resumable_start(records, index, base, name, offset, count, pipeline)
        for file, size in ((records, offset), (index, count * ENTRY.size)):
            file.truncate(size)
            file.seek(size)
        return cls(
            directory,
            name,
            PendingFile(records, base + ".records" + PARTIAL, base + ".records", stage, offset),
            PendingFile(
                index, base + ".index" + PARTIAL, base + ".index", stage, count * ENTRY.size
            ),
            start,
            offset,
            count,
        )

    def add(self, index: int, payload: bytes) -> None:
        """Append ``payload`` as the record of element ``index``."""
        framing = frame_record(index, payload)
        self._records.write(framing)
        self._records.write(payload)
        self._index.write(ENTRY.pack(index, self.offset, len(framing) + len(payload)))
        self.offset += len(framing) + len(payload)
        self.count += 1

    def flush(self, sync: bool) -> None:
        """Hand what was written to the kernel (a killed process loses none of it); with
        ``sync``, to the disk (a checkpoint that names it survives a power loss too)."""
        for file in (self._records, self._index):
            file.flush(sync)

    def finish(self) -> dict[str, Any]:
        """Write the footer, make both files durable and give them their final names.

        Returns:
            The shard's entry in the manifest.
        """
        self._records.write(FOOTER.pack(self.count, self.offset - self._start, END_MAGIC))
        self._records.publish()
        self._index.publish()
        base = os.path.join(self.directory, self.name)
        with open(base + ".index", "rb") as f:
            index_crc = zlib.crc32(f.read())
        return {
            "records_file": self.name + ".records",
            "index_file": self.name + ".index",
            "records": self.count,
            "bytes": os.path.getsize(base + ".records"),
            "index_crc32": index_crc,
        }

    def close(self) -> None:
        """Close the files, leaving them as they are (a later save may resume them); never raises
        for what a full disk could not take (a resume cuts the files back to a checkpoint)."""
        self._records.abort()
        self._index.abort()


# -- the manifest ----------------------------------------------------------------------------------
def write_manifest(directory: str, manifest: dict[str, Any], stage: str = "save") -> None:
    """Publish ``manifest`` atomically: a reader finds the old one, the new one, or none.

    Raises:
        DiskFullError: if the disk is full (the old manifest, if any, stays).
    """
    write_file(
        os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1).encode("utf-8"), stage
    )
    sync_directory(directory)


def sync_directory(directory: str) -> None:
    """Make renames in ``directory`` durable (where the platform can)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of the saved dataset in ``directory``.

    Raises:
        FileNotFoundError: if there is none (nothing was saved there, or a save did not complete).
        SavedFormatError: if it is malformed or from a newer torchpipe.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no saved dataset at {directory!r}: not a directory")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"no saved dataset at {directory!r}: it has no {MANIFEST} (nothing was saved "
            "there, or the save did not complete; saving again resumes it)"
        ) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise SavedFormatError(f"{path!r} is not a valid manifest: {e}") from e
    _check_manifest(manifest, path)
    return manifest


def _check_manifest(manifest: Any, path: str) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SavedFormatError(f"{path!r} is not the manifest of a torchpipe saved dataset")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > FORMAT_VERSION:
        raise SavedFormatError(
            f"{path!r} has format version {manifest.get('version')!r}; this torchpipe reads "
            f"up to {FORMAT_VERSION}"
        )
    try:
        (
            int(manifest["count"]),
            check_compression(manifest["compression"]),
            origin_of(manifest["origin"]),
        )
        for shard in manifest["shards"]:
            (
                str(shard["records_file"]),
                str(shard["index_file"]),
                int(shard["records"]),
                int(shard["bytes"]),
            )
            int(shard["index_crc32"])
    except (KeyError, TypeError, ValueError) as e:
        raise SavedFormatError(f"{path!r} is a malformed manifest ({e!r})") from e
    for shard in manifest["shards"]:
        for key in ("records_file", "index_file"):
            _check_file_name(shard[key], key, path)
    if sum(int(shard["records"]) for shard in manifest["shards"]) != manifest["count"]:
        raise SavedFormatError(
            f"{path!r}: the shards' records do not add up to the count {manifest['count']}"
        )


def _check_file_name(name: Any, key: str, path: str) -> None:
    """Raise unless ``name`` is a plain file name: a manifest never reads outside its directory."""
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and "/" not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )
    if not plain:
        raise SavedFormatError(
            f"{path!r}: {key} {name!r} is not a plain file name in the manifest's directory "
            "(a manifest names only files next to it)"
        )


# -- reading ---------------------------------------------------------------------------------------
class SavedRecords:
    """The elements of a saved dataset, as a map-style dataset: ``records[i]`` is element ``i``.

    Opening reads the manifest and every shard's index (checked against the manifest's CRC), and
    checks that the shards hold each element exactly once. Reading element ``i`` is one
    ``os.pread``; its record is checked against its CRC and its index before it is decoded.
    Decoding unpickles with torchpipe's restricted unpickler (``runtime/codec/restricted.py``)
    unless ``trusted``.

    Args:
        path: the directory ``ds.save(path)`` wrote.
        trusted: unpickle records with full pickle, which runs any code they hold.

    Attributes:
        manifest: the manifest (``element_spec``, ``pipeline``, ``origin``, ...).

    Raises:
        FileNotFoundError: if ``path`` holds no complete saved dataset.
        SavedFormatError: if the manifest or an index is damaged, or a shard file has the wrong size.
        DataLossError: (reading) if a record is damaged, naming the file and the byte offset.
        UntrustedTypeError: (reading) if a record holds a type outside the allow-list.
    """

    def __init__(self, path: str | os.PathLike, trusted: bool = False) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self.trusted = trusted
        # pickled with the records, it allows in workers what is allowed here
        self._safe_globals = SafeGlobals()
        self.manifest = read_manifest(self.path)
        # "gzip" reads as GZIP
        self.compression: str | None = check_compression(self.manifest["compression"])
        self.origin: Origin = origin_of(self.manifest["origin"])
        self._files = [
            os.path.join(self.path, shard["records_file"]) for shard in self.manifest["shards"]
        ]
        self._shard, self._offset, self._length = self._read_indexes()
        self._local = ProcessLocalFiles()

    def _read_indexes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts, owners = [], []
        for number, shard in enumerate(self.manifest["shards"]):
            entries = self._shard_index(shard)
            parts.append(entries)
            owners.append(np.full(len(entries), number, dtype=np.int32))
        entries = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)
        owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int32)
        order = np.argsort(entries[:, 0], kind="stable")
        count = self.manifest["count"]
        if not np.array_equal(entries[order, 0], np.arange(count, dtype=np.uint64)):
            raise SavedFormatError(
                f"saved dataset {self.path!r} is damaged: its shards do not hold elements "
                f"0..{count - 1} exactly once each"
            )
        return owner[order], entries[order, 1].astype(np.int64), entries[order, 2].astype(np.int64)

    def _shard_index(self, shard: dict[str, Any]) -> np.ndarray:
        records, index = (
            os.path.join(self.path, shard[key]) for key in ("records_file", "index_file")
        )
        try:
            size = os.path.getsize(records)
            with open(index, "rb") as f:
                data = f.read()
        except OSError as e:
            raise SavedFormatError(f"saved dataset {self.path!r} is incomplete: {e}") from e
        if size != shard["bytes"]:
            raise SavedFormatError(
                f"shard {records!r} has {size} bytes, its manifest says {shard['bytes']}"
            )
        if zlib.crc32(data) != shard["index_crc32"] or len(data) != shard["records"] * ENTRY.size:
            raise SavedFormatError(
                f"index {index!r} is damaged (its CRC or length does not match the manifest)"
            )
        return np.frombuffer(data, dtype="<u8").reshape(-1, 3)

    @property
    def element_spec(self) -> Any:
        """The structure of the elements, with dtypes and shapes (``None`` where they vary)."""
        return self.manifest.get("element_spec")

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def __getitem__(self, i: int) -> Any:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(
                f"saved dataset {self.path!r}: index {i} out of range for {n} elements"
            )
        i = int(i) % n
        shard, offset, length = int(self._shard[i]), int(self._offset[i]), int(self._length[i])
        path = self._files[shard]
        framed = os.pread(self._local.descriptor(shard, path), length, offset)
        return self._decode(framed, i, path, offset, length)

    def _decode(self, framed: bytes, i: int, path: str, offset: int, length: int) -> Any:
        if len(framed) < length:
            raise DataLossError(
                f"{path}: truncated record at byte {offset} (element {i})", path, offset
            )
        size, index, crc = RECORD.unpack_from(framed)
        payload = framed[RECORD.size :]
        if size != len(payload) or record_crc(index, payload) != crc:
            raise DataLossError(
                f"{path}: damaged record at byte {offset} (element {i}): its checksum does not "
                "match",
                path,
                offset,
            )
        if index != i:
            raise DataLossError(
                f"{path}: the record at byte {offset} is element {index}, not {i}", path, offset
            )
        try:
            return codec.decode_bytes(
                decompress(payload, self.compression), restricted=not self.trusted
            )
        except UntrustedTypeError as e:
            add_note(
                e,
                f"reading element {i} of the saved dataset {self.path!r} (record at byte {offset} of {path})",
            )
            raise
        except Exception as e:
            raise DataLossError(
                f"{path}: the record at byte {offset} (element {i}) cannot be decoded: {e}",
                path,
                offset,
            ) from e

    def __repr__(self) -> str:
        return f"SavedRecords({self.path!r}, {len(self)} elements)"


def lock_directory(directory: str) -> BinaryIO | None:
    """An exclusive lock on ``directory`` (its ``.lock`` file held open), or None if another process
    holds it. The kernel drops it when the holder dies, so a killed writer never blocks the next."""
    # a symlink planted there is refused
    file = open_no_follow(os.path.join(directory, LOCK), "a+b")
    if try_lock(file):
        return file
    file.close()
    return None


def remove_files(directory: str, keep: str | None = None) -> None:
    """Remove the shard files and manifest temporaries in ``directory`` not of generation ``keep``,
    and ``keep``'s partial files: once it is published (or is the published one), they are strays."""
    for name in os.listdir(directory):
        ours = keep is not None and name.startswith(f"shard-{keep}-") and not name.endswith(PARTIAL)
        if (name.startswith("shard-") and not ours) or name.startswith(f"{MANIFEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))

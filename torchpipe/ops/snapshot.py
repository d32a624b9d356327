"""``snapshot(path)``: a pipeline's output kept on disk across jobs, under the pipeline's fingerprint.

A snapshot is a saved dataset (:mod:`torchpipe.storage.saved_file`) in ``<path>/<fingerprint>/``, where the
fingerprint digests the pipeline above the snapshot: every op with its parameters and each
function's code (``storage/fingerprint.py``). So a job running the same pipeline finds it and a
changed pipeline writes a new one next to it. The op is ``cache``'s iterator
(:class:`~torchpipe.ops.cache.CacheIterator`: the first complete pass stores, later passes replay,
checkpoints in every mode) over a storage that writes shards on writer threads while the pass is
consumed and publishes the manifest when the pass completes. One process at a time writes a
snapshot (an ``flock`` on its directory, dropped by the kernel if the writer dies); a job that finds
it taken computes its pass without writing, and reads the snapshot once it is published. A pass
that runs out of room raises :class:`~torchpipe.errors.DiskFullError` naming the file and the bytes
written, removes its files and publishes nothing; the next pass writes the snapshot again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
import weakref
from typing import Any, BinaryIO

from torchpipe.core.arguments import require_bool, require_path
from torchpipe.core.node import Node
from torchpipe.observe.progress import ProgressBar
from torchpipe.ops.cache import CacheNode
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.storage.cache_file import Origin, origin_of, read_header
from torchpipe.storage.fingerprint import describe_ops
from torchpipe.storage.save_writers import ShardWriters
from torchpipe.storage.saved_file import (
    FORMAT,
    FORMAT_VERSION,
    PARTIAL,
    SavedFormatError,
    SavedRecords,
    ShardFile,
    check_compression,
    lock_directory,
    new_generation,
    read_manifest,
    remove_files,
    shard_name,
    write_manifest,
)

_POSITION, _TEMP, _OFFSET, _WRITTEN = (
    "position",
    "temp",
    "offset",
    "written",
)  # CacheIterator's state keys


def check_snapshot_args(path: Any, compression: Any, trusted: Any) -> tuple[str, str | None]:
    """Raise at ``snapshot(...)`` for a ``path`` that is not a non-empty str or os.PathLike, a
    ``trusted`` not a bool, or a ``compression`` other than None, ``"GZIP"`` or ``"ZLIB"``.

    Returns:
        ``path`` as a str and the compression's name, as :class:`SnapshotNode` takes them.
    """
    require_path("snapshot", path)
    require_bool("snapshot", "trusted", trusted)
    return os.fsdecode(os.fspath(path)), check_compression(compression)


class SnapshotNode(CacheNode):
    """The input's elements, from the snapshot of this pipeline under ``path`` once one exists.

    Args:
        input: the input node.
        path: the directory that holds the snapshots.
        compression: ``None``, ``"GZIP"`` or ``"ZLIB"``.
        trusted: read the snapshot's records with full pickle, not the restricted unpickler.
    """

    kind = "snapshot"

    def __init__(
        self, input: Node, path: str, compression: str | None, trusted: bool = False
    ) -> None:
        Node.__init__(self, input)
        self.path = path
        self.compression = compression
        self.storage = SnapshotStorage(  # type: ignore[assignment]  # a cache's storage calls: replay, recorder, ...
            path, describe_ops(input, code=True), compression, input.cardinality(), trusted
        )
        self.name = f"snapshot({path})"

    def params(self) -> dict[str, Any]:
        return {"path": self.path, "compression": self.compression}


def snapshot_directory(root: str, upstream: list[str]) -> str:
    """Where the snapshot of the pipeline ``upstream`` (its fingerprint lines) lives under ``root``."""
    return os.path.join(
        root, hashlib.sha1("\n".join(upstream).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    )


class SnapshotStorage:
    """The storage interface of :class:`~torchpipe.ops.cache.CacheIterator` over a snapshot directory.

    Args:
        root: the directory that holds the snapshots.
        upstream: the fingerprint of the pipeline above the snapshot (with functions' code).
        compression: how records are compressed.
        total: the input's cardinality, for the progress bar.
        trusted: read records with full pickle (``SavedRecords``'s ``trusted``).
    """

    def __init__(
        self,
        root: str,
        upstream: list[str],
        compression: str | None,
        total: int,
        trusted: bool = False,
    ) -> None:
        self.root = root
        self.trusted = trusted
        self.upstream = upstream
        self.compression = compression
        self.total = total
        self.directory = snapshot_directory(root, upstream)
        self.stage = f"snapshot({root})"

    def replay(self, origin: Origin | None, state: dict[str, Any] | None) -> SnapshotReplay | None:
        """A reader of the published snapshot at ``state``'s position (if ``origin``'s pass wrote
        it), or None: no snapshot yet, another pass's, or a damaged one (with a warning)."""
        try:
            records = SavedRecords(self.directory, self.trusted)
        except FileNotFoundError:
            return None
        except SavedFormatError as e:
            warnings.warn(
                f"snapshot {self.directory!r} is damaged ({e}); this pass computes its elements and "
                "writes it again",
                stacklevel=2,
            )
            return None
        position = 0 if state is None else int(state[_POSITION])
        if records.manifest["pipeline"] != self.upstream or (
            origin is not None and records.origin != origin
        ):
            return None
        return SnapshotReplay(records, position) if position <= len(records) else None

    def recorder(self, origin: Origin) -> SnapshotRecorder | None:
        """A writer of a new snapshot, or None if another process is writing it or it just appeared."""
        lock = self._lock()
        if lock is None:
            return None
        remove_files(self.directory)  # partial files of a writer that was killed
        generation = new_generation()
        writers = self._writers(generation, origin, {}, None)
        return SnapshotRecorder(self, lock, writers, generation, origin, 0)

    def resume_recorder(self, state: dict[str, Any]) -> SnapshotRecorder | None:
        """The interrupted fill of a checkpoint, cut back to it and going on, or None if its files
        are gone or another process writes the snapshot now."""
        generation, count, position = state[_TEMP], state[_WRITTEN], state[_OFFSET]
        if not isinstance(generation, str) or not isinstance(position, list) or len(position) != 2:
            return None
        shards, spec = position
        lock = self._lock()
        if lock is None:
            return None
        try:
            resumed = {
                int(shard): ShardFile.resume(
                    self.directory,
                    shard_name(generation, int(shard)),
                    int(offset),
                    int(records),
                    self.upstream,
                    self.stage,
                )
                for shard, offset, records in shards
            }
        except SavedFormatError:
            lock.close()
            return None
        origin = self._origin_of(resumed, generation)
        writers = self._writers(generation, origin, resumed, spec)
        return SnapshotRecorder(self, lock, writers, generation, origin, int(count))

    def _origin_of(self, resumed: dict[int, ShardFile], generation: str) -> Origin:
        for shard in resumed:
            with open(
                os.path.join(self.directory, shard_name(generation, shard) + ".records" + PARTIAL),
                "rb",
            ) as f:
                return origin_of(read_header(f, f.name)[2]["origin"])
        return (0, 0, ())

    def _lock(self) -> BinaryIO | None:
        os.makedirs(self.directory, exist_ok=True)
        lock = lock_directory(self.directory)
        if lock is not None and self._published():
            lock.close()  # published since this pass looked: the next pass reads it
            return None
        return lock

    def _published(self) -> bool:
        """Whether a readable manifest is there (a damaged one is written over)."""
        try:
            read_manifest(self.directory)
        except (FileNotFoundError, SavedFormatError):
            return False
        return True

    def _writers(
        self, generation: str, origin: Origin, resumed: dict[int, ShardFile], spec: Any
    ) -> ShardWriters:
        return ShardWriters(
            self.directory,
            generation,
            origin,
            self.upstream,
            self.compression,
            usable_cpu_count(),
            resumed,
            spec,
            self.stage,
        )


class SnapshotReplay:
    """Reads a published snapshot from a position; its state is the position alone."""

    def __init__(self, records: SavedRecords, position: int) -> None:
        self._records = records
        self.origin = records.origin
        self.position = position

    def next(self) -> Any:
        if self.position >= len(self._records):
            raise StopIteration
        self.position += 1  # a damaged record raises in its place and the pass goes on past it
        return self._records[self.position - 1]

    def state(self) -> dict[str, Any]:
        return {_POSITION: self.position}

    def close(self) -> None:
        pass


class SnapshotRecorder:
    """Writes a filling pass's elements to shards and publishes the snapshot when the pass completes.

    It holds the snapshot's lock until it commits or is discarded (or its process dies).
    """

    def __init__(
        self,
        storage: SnapshotStorage,
        lock: BinaryIO,
        writers: ShardWriters,
        generation: str,
        origin: Origin,
        count: int,
    ) -> None:
        self._storage = storage
        self._lock = lock
        self._writers = writers
        self._generation = generation
        self._origin = origin
        self._count = count
        self._shards = usable_cpu_count()
        self._bar = ProgressBar(storage.stage, storage.total, initial=count)
        self._finalizer = weakref.finalize(
            self, _abandon, writers, storage.directory, generation, lock, self._bar
        )

    def add(self, element: Any) -> None:
        self._writers.add(self._count % self._shards, self._count, element)
        self._count += 1
        self._bar.update()

    def state(self) -> dict[str, Any]:
        # Flushed so that a process killed after this checkpoint can still resume the snapshot. The
        # shards' positions are a list, not a dict: a state keeps its nested keys in every mode.
        self._writers.drain(sync=False)
        shards = [
            [shard, offset, records]
            for shard, (offset, records) in sorted(self._writers.positions().items())
        ]
        return {
            _TEMP: self._generation,
            _OFFSET: [shards, self._writers.spec],
            _WRITTEN: self._count,
        }

    def commit(self) -> None:
        """Finish the shards and publish the manifest; the lock is then released."""
        entries = self._writers.finish()
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "generation": self._generation,
            "count": self._count,
            "compression": self._storage.compression,
            "element_spec": self._writers.spec,
            "pipeline": self._storage.upstream,
            "origin": [self._origin[0], self._origin[1], list(self._origin[2])],
            "shards": entries,
        }
        write_manifest(self._storage.directory, manifest, self._storage.stage)
        self._finalizer.detach()
        remove_files(self._storage.directory, self._generation)
        self._bar.close()
        self._lock.close()

    def discard(self) -> None:
        """Stop writing and remove this pass's files (a closed pass cannot be resumed)."""
        self._finalizer()


def _abandon(
    writers: ShardWriters, directory: str, generation: str, lock: BinaryIO, bar: ProgressBar
) -> None:
    writers.close()
    # shards finished before a failed commit too: no manifest names them
    for name in os.listdir(directory):
        if name.startswith(f"shard-{generation}-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
    bar.close()
    lock.close()

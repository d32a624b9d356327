"""WebDataset tar shards: ``tp.from_webdataset`` and ``tp.io.TarWriter``.

A shard is a tar file whose consecutive members with the same key form a sample, as the
``webdataset`` package groups them: a member ``dir/abc.seg.png`` has key ``dir/abc`` and
extension ``seg.png`` (split at the first dot of the basename; extensions lower-cased). A
sample is ``{"__key__": key, "__url__": shard, ext: bytes, ...}``. Members that are not regular
files, have no dot, or are ``__meta__`` files are skipped.

A shard's reader is a source whose checkpoint is ``{url, offset}``: the byte where the next
sample's first member starts, so a resume seeks (for ``.tar.gz`` shards: the offset in the
uncompressed stream, read up to on resume).
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from torchpipe.arguments import require_bool, require_int, require_seed
from torchpipe.constants import AUTOTUNE, UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.dataset import Dataset
from torchpipe.distributed.nodes import SplitFilesNode
from torchpipe.io import remote
from torchpipe.io.addresses import AddressFormat, FileAddresses, RecordFetch
from torchpipe.io.decoders import SampleDecoder, encode_field
from torchpipe.io.files import (
    DataLossError,
    FileReaderIterator,
    OutputFile,
    check_path,
    open_stream,
    path_dataset,
    read_each,
)
from torchpipe.ops.source_nodes import FileOpener, IndexedFiles

_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


def split_name(name: str) -> tuple[str | None, str | None]:
    """``(key, extension)`` of a member name, split at the first dot of its basename."""
    match = _KEY_AND_EXTENSION.match(name)
    return (match.group(1), match.group(2)) if match else (None, None)


def _compression(url: str) -> str | None:
    return "GZIP" if url.endswith((".tar.gz", ".tgz")) else None


def sample_member(info: tarfile.TarInfo) -> tuple[str, str] | None:
    """``(key, extension)`` (lower-cased) of a member that belongs to a sample; None for one a
    reader skips (not a regular file, no dot, a ``__meta__`` file)."""
    key, ext = split_name(info.name)
    if not info.isreg() or key is None or ext is None or _META.match(info.name):
        return None
    return key, ext.lower()


def damaged(url: str, offset: int, error: BaseException) -> DataLossError:
    return DataLossError(f"{url}: damaged tar shard at byte {offset}: {error}", url, offset)


def two_files(url: str, key: str, ext: str, offset: int) -> DataLossError:
    return DataLossError(
        f"{url}: sample {key!r} has two {ext!r} files (the second at byte {offset})", url, offset
    )


class TarShardNode(Node):
    """The samples of one tar shard, grouped by key."""

    kind = "tar_shard"

    def __init__(self, url: str, buffer_size: int | None, retry: remote.RetryPolicy | None) -> None:
        super().__init__()
        self.url, self.buffer_size, self.retry = url, buffer_size, retry

    def params(self) -> dict[str, Any]:
        return {"url": self.url}

    def cardinality(self) -> int:
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return TarShardIterator(self)


class TarShardIterator(FileReaderIterator):
    """Reads one shard sample by sample; its state is ``{file, offset, done}``, ``offset`` being
    where the next sample's first member starts.

    A damaged shard raises :class:`DataLossError` (naming the shard and the offset) once and
    then ends, so that under ``ignore_errors()`` reading goes on at the next shard.
    """

    def __init__(self, node: TarShardNode) -> None:
        super().__init__(f"tar_shard({node.url.rsplit('/', 1)[-1]})", node.url)
        self._node = node
        self._tar: tarfile.TarFile | None = None
        self._pending: tuple[str, str, bytes, int] | None = None

    def start(self) -> None:
        if self._done:
            return
        node = self._node
        self._stream = open_stream(
            node.url, _compression(node.url), node.buffer_size, self._offset, node.retry
        )
        self._base = self._offset
        try:
            self._tar = tarfile.open(fileobj=self._stream, mode="r|")  # noqa: SIM115 - closed by close()
        except tarfile.ReadError as e:
            if "empty file" not in str(e):
                raise damaged(self._node.url, self._offset, e) from e
            self._done = True

    def read_next(self) -> dict[str, Any]:
        sample: dict[str, Any] | None = None
        while True:
            item, self._pending = self._pending or self._next_member(), None
            if item is None:
                if sample is None:
                    raise StopIteration
                self._done = True  # the last sample: a checkpoint after it is at the end
                self.shutdown()
                return sample
            key, ext, data, offset = item
            if sample is None:
                sample = {"__key__": key, "__url__": self._node.url}
            elif key != sample["__key__"]:
                self._pending, self._offset = item, offset
                return sample
            if ext in sample:
                raise two_files(self._node.url, key, ext, offset)
            sample[ext] = data

    def _next_member(self) -> tuple[str, str, bytes, int] | None:
        """The next regular file that belongs to a sample: ``(key, ext, data, offset)``."""
        tar = self._tar
        assert tar is not None  # opened before the first read
        while True:
            at = self._base + tar.offset
            try:
                info = tar.next()
                if info is None:
                    return None
                data = tar.extractfile(info).read() if info.isreg() else None  # type: ignore[union-attr]  # a regular file's
            except (tarfile.TarError, EOFError) as e:
                raise damaged(self._node.url, at, e) from e
            tar.members = []  # type: ignore[attr-defined]  # a stream is read once: keep no member list
            member = sample_member(info)
            if member is None or data is None:  # None together: a regular file's data
                continue
            key, ext = member
            return key, ext, data, self._base + info.offset

    def shutdown(self) -> None:
        self._tar = None
        super().shutdown()


class TarShardReader(FileOpener):
    """The function ``from_webdataset`` maps each shard URL to: a dataset of its samples."""

    __name__ = "tar_shard"

    def __init__(self, buffer_size: int | None, retry: remote.RetryPolicy | None) -> None:
        self.buffer_size, self.retry = buffer_size, retry

    def __call__(self, url: Any) -> Dataset:
        return Dataset(
            TarShardNode(check_path("from_webdataset", url), self.buffer_size, self.retry)
        )

    def indexed(self, paths: list[str]) -> IndexedFiles | None:
        """Local uncompressed shards are read by sample address (``io/addresses.py``)."""
        if any(remote.is_url(path) or _compression(path) for path in paths):
            return None
        fmt = TarAddressFormat()
        return IndexedFiles(FileAddresses(fmt), RecordFetch(fmt))


class TarAddressFormat(AddressFormat):
    """Tar shards read by sample address: a sample's bytes run from its first member's header to
    the next sample's (to its last member's end for the last), as its reader's offsets do."""

    kind = "tar_shard"
    last_is_done = True

    def index(self, path: str) -> tuple[np.ndarray, DataLossError | None]:
        """The samples' ``(offset, length)``, as far as the shard's reader reads: where it fails,
        the sample it was reading is left out, and its error returned."""
        starts: list[int] = []
        end, key, error = 0, None, None
        exts: set[str] = set()
        try:
            # "r:" seeks over the members' data
            with tarfile.open(remote.local_path(path), mode="r:") as tar:
                while True:
                    at = tar.offset
                    try:
                        info = tar.next()
                    except (tarfile.TarError, EOFError) as e:
                        error = damaged(path, at, e)
                        break
                    if info is None:
                        break
                    tar.members = []  # type: ignore[attr-defined]  # keep no member list
                    member = sample_member(info)
                    if member is None:
                        continue
                    name_key, ext = member
                    if name_key != key:
                        starts.append(info.offset)
                        key, exts = name_key, set()
                    elif ext in exts:
                        error = two_files(path, key, ext, info.offset)
                        break
                    exts.add(ext)
                    end = info.offset_data + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        except tarfile.ReadError as e:  # not a tar at all (an empty file is a shard of no samples)
            if "empty file" not in str(e):
                error = damaged(path, 0, e)
        if error is not None and starts:
            end = starts.pop()  # the sample its reader was reading when it failed
        ends = [*starts[1:], end]
        return np.array([starts, [e - s for s, e in zip(starts, ends)]], dtype=np.int64).T.reshape(
            -1, 2
        ), error

    def record(self, data: memoryview, path: str, offset: int) -> dict[str, Any]:
        sample: dict[str, Any] = {}
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
                for info in tar:
                    member = sample_member(info)
                    if member is None:
                        continue
                    key, ext = member
                    sample.setdefault("__key__", key)
                    sample.setdefault("__url__", path)
                    sample[ext] = tar.extractfile(info).read()  # type: ignore[union-attr]  # a regular file's
        except (tarfile.TarError, EOFError) as e:
            raise damaged(path, offset, e) from e
        return sample


def from_webdataset(
    urls: Any,
    *,
    shardshuffle: bool = False,
    seed: int | None = None,
    split_by_rank: bool = True,
    num_parallel_reads: int | None = None,
    decode: bool | Callable[[dict[str, Any]], Any] = False,
    buffer_size: int | None = None,
    retry: remote.RetryPolicy | None = None,
) -> Dataset:
    """The samples of WebDataset tar shards, as dicts (``__key__``, ``__url__``, one ``bytes``
    per extension).

    Args:
        urls: a shard path or URL with brace ranges (``shard-{000000..000146}.tar``), or a list.
        shardshuffle: shuffle the shard order each epoch (seeded by ``seed``, else the pipeline
            seed; with several ranks every rank must share it).
        split_by_rank: on several ranks (``torch.distributed``, or
            ``tp.DistributeOptions(rank=..., world_size=...)``) each rank reads every
            ``world_size``-th shard after the shard shuffle, and each of its torch DataLoader
            workers its share of those: the split every pipeline gets (docs/distributed.md),
            following the pipeline's ``DistributeOptions``. False: every rank reads every shard
            (under ``policy="auto"``; ``"file"`` and ``"data"`` still split as they say).
        num_parallel_reads: ``None`` reads shards one after another; ``n`` or ``tp.AUTOTUNE``
            interleaves ``n`` shards, a sample from each in turn, read ahead in parallel.
        decode: True decodes fields by extension (``tp.io.SampleDecoder()``); or a function of
            the sample.
        buffer_size: read buffer per shard (default 256 KB locally, 8 MB for URLs).
        retry: how reads of URLs are retried.

    Raises:
        TypeError, ValueError: for bad arguments.
    """
    op = "from_webdataset"
    _check_arguments(
        op, urls, shardshuffle, seed, split_by_rank, num_parallel_reads, decode, buffer_size
    )
    shards = _shards(path_dataset(op, urls, braces=True), shardshuffle, seed, split_by_rank)
    samples = read_each(shards, TarShardReader(buffer_size, retry), num_parallel_reads)
    if decode is False:
        return samples
    return samples.map(SampleDecoder() if decode is True else decode)


def _shards(files: Dataset, shardshuffle: bool, seed: int | None, split_by_rank: bool) -> Dataset:
    """The shards to read, in their order: ``files`` shuffled each epoch (with ``shardshuffle``),
    then marked where they are split between ranks."""
    if shardshuffle:
        files = files.shuffle(len(files), seed=seed)
    # The split goes after the shard shuffle, through the distribution rewrite (so that the
    # pipeline's DistributeOptions decide); split_by_rank=False is a mark that keeps it out.
    return Dataset(
        SplitFilesNode(files._node, shuffled=shardshuffle and seed is None, split=split_by_rank)
    )


def _check_arguments(
    op: str,
    urls: Any,
    shardshuffle: Any,
    seed: Any,
    split_by_rank: Any,
    num_parallel_reads: Any,
    decode: Any,
    buffer_size: Any,
) -> None:
    require_bool(op, "shardshuffle", shardshuffle)
    require_bool(op, "split_by_rank", split_by_rank)
    require_seed(op, seed)
    if num_parallel_reads is not None and num_parallel_reads != AUTOTUNE:
        require_int(op, "num_parallel_reads", num_parallel_reads, minimum=1)
    if buffer_size is not None:
        require_int(op, "buffer_size", buffer_size, minimum=1)
    if not (isinstance(decode, bool) or callable(decode)):
        raise TypeError(
            f"{op}: decode must be a bool or a function of the sample, got {type(decode).__name__}"
        )
    if isinstance(urls, Dataset):
        raise TypeError(f"{op}: urls must be a str or a list of str (a shard list of known length)")


class TarWriter:
    """Writes WebDataset samples to a tar shard that ``webdataset`` reads back unchanged.

    Each sample is a dict with a ``__key__`` (no dot in its basename) and one value per
    extension: ``bytes`` as they are, or values the extension has an encoder for (images for
    ``jpg``/``png``/..., ``str`` and numbers as text, ``json``, ``npy``, ``pth``). Members are
    written in the dict's order, read-only, with a fixed ``mtime`` so the same samples make the
    same bytes.

    A local shard is written under a temporary name next to ``path`` (``<path>.tmp-<pid>-<random>``)
    and renamed to ``path`` when closed, so a file at ``path`` is always a complete shard, and one
    there before stays until then. If a write fails (a full disk), the ``with`` block raises, or
    the writer is dropped unclosed, the temporary file is removed and nothing is published. A URL
    is written through fsspec, whose store publishes it on close.

    Args:
        path: a local path or URL (``.tar.gz``/``.tgz`` is gzip-compressed).
        mtime: the members' modification time (seconds since the epoch).

    Raises:
        DiskFullError: (writing, closing) if the disk is full or the file would pass
            ``RLIMIT_FSIZE``, naming the file and the bytes written; the writer is then closed.
    """

    def __init__(self, path: Any, mtime: float = 0.0) -> None:
        self.path = check_path("TarWriter", path)
        self._file = OutputFile(self.path, f"TarWriter({self.path})")
        mode = "w|gz" if _compression(self.path) else "w|"
        self._tar = tarfile.open(  # noqa: SIM115 - the writer's, closed by close()
            fileobj=self._file,
            mode=mode,
            format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
        )
        self._mtime = mtime

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample.

        Raises:
            ValueError: for a missing or dotted key, or an extension with a ``/``; after
                :meth:`close`, or after a write that failed.
            TypeError: for a value with no encoder (pass bytes).
        """
        if self._file.closed:
            raise ValueError(f"TarWriter: {self.path} is closed")
        key = sample.get("__key__") if isinstance(sample, Mapping) else None
        if not isinstance(key, str) or not key or "." in key.rsplit("/", 1)[-1]:
            raise ValueError(
                f"TarWriter: a sample needs a '__key__' str without a dot in its basename, got {key!r}"
            )
        members = [
            (ext, encode_field(ext, v)) for ext, v in sample.items() if not ext.startswith("__")
        ]
        for ext, data in members:
            if not ext or "/" in ext:
                raise ValueError(
                    f"TarWriter: extension {ext!r} of sample {key!r} must be non-empty, without '/'"
                )
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), self._mtime, 0o444
            info.uname = info.gname = "torchpipe"
            try:
                self._tar.addfile(info, io.BytesIO(data))
            except BaseException:
                self._abandon()  # the file is discarded: the archive must not write its end into it
                raise

    def close(self) -> None:
        """Finish the archive and publish the file at ``path``; idempotent."""
        if self._file.closed:
            return
        try:
            self._tar.close()  # its last blocks, through the file: a write that fails discards it
        except BaseException:
            self._abandon()
            raise
        self._file.publish()

    def _abandon(self) -> None:
        """Leave the archive without its end (the file is discarded): tarfile's stream would write
        it when it is dropped, into a closed file."""
        self._tar.closed = True
        stream = self._tar.fileobj
        if stream is not None and hasattr(stream, "closed") and stream is not self._file:
            stream.closed = True

    def __enter__(self) -> TarWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._file.discard()  # the block did not finish: its shard is not complete
            self._abandon()
        else:
            self.close()

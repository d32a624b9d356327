"""The benchmark's workloads: the same per-item work, fed to every loader under test.

A workload gives a torch dataset (for the DataLoader configurations), a torchpipe pipeline
builder (for the DSL configurations) over exactly the same per-item function, a batch counter
(items and units of the workload's throughput), a grid of explicit torchpipe knobs, and the
physical limit of the machine for it. Per-item functions are module-level classes so worker
processes can run them.
"""

from __future__ import annotations

import itertools
import math
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

import torchpipe as tp
from bench import data
from torchpipe.runtime.cpu import usable_cpu_count

CROP = 224


@dataclass
class Sizes:
    """How much data the run generates and how long each measurement lasts."""

    jpeg_files: int
    text_docs: int
    tiny_elements: int
    shard_records: int
    cache_files: int
    warmup_s: float
    seconds: float
    limit_s: float
    blob_samples: int = 4000
    """Samples in one epoch of ``blobs`` (issue #33: 4,000, so an epoch lasts tens of ms)."""
    epochs: int = 4
    """Epochs measured on ``blobs``, each from ``iter()`` to its end, on one loader."""
    steady_s: float | None = None
    """The zero-knob rows' window (None: ``seconds``): long enough that their placement's trials
    are over, so their throughput is their steady rate (issue #57)."""
    photo_files: int | None = None
    """Photo-like JPEGs of the training-transform workloads (``bench/training.py``; None:
    ``jpeg_files``)."""


QUICK = Sizes(
    jpeg_files=1024,
    text_docs=1000,
    tiny_elements=200_000,
    shard_records=2048,
    cache_files=1024,
    warmup_s=1.0,
    seconds=4.0,
    limit_s=0.4,
    steady_s=6.0,
    photo_files=512,
)
"""``--quick``: small data, and windows long enough that the zero-knob rows read their steady
state, not their first second of probing executors (issue #42: at 0.4 + 1.2 s they read 0.47-0.89x
of the best placement by hand on the large-batch workloads, at 1 + 6 s 0.90-0.97x; issue #57: the
zero-knob rows 1 + 6 s, the rows with fixed knobs, which try nothing, 1 + 4 s)."""
FULL = Sizes(
    jpeg_files=2048,
    text_docs=4000,
    tiny_elements=1_000_000,
    shard_records=4096,
    cache_files=2048,
    warmup_s=1.0,
    seconds=4.0,
    limit_s=1.5,
    epochs=8,
    steady_s=6.0,
)


class Mapped(torch.utils.data.Dataset):
    """``fn(i)`` for ``i`` in ``range(length)``: the map-style dataset DataLoader configurations get."""

    def __init__(self, fn: Callable[[int], Any], length: int) -> None:
        self.fn, self.length = fn, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.fn(i)


# -- per-item work ----------------------------------------------------------------------------
class DecodeJpeg:
    """File ``i % len(paths)`` decoded with Pillow to an HWC uint8 array, and its label."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __call__(self, i: int) -> tuple[np.ndarray, int]:
        with Image.open(self.paths[i % len(self.paths)]) as image:
            return np.asarray(image.convert("RGB")), i % 1000


def augment(image: np.ndarray, label: int) -> tuple[torch.Tensor, int]:
    """A random 224 crop and a random horizontal flip, as a CHW uint8 tensor."""
    y = random.randrange(image.shape[0] - CROP + 1)
    x = random.randrange(image.shape[1] - CROP + 1)
    crop = image[y : y + CROP, x : x + CROP]
    if random.random() < 0.5:
        crop = crop[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1))), label


class JpegSample:
    """The ``jpeg`` workload's item: decode, crop, flip."""

    def __init__(self, paths: list[str]) -> None:
        self.decode = DecodeJpeg(paths)

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        return augment(*self.decode(i))


def big_tensor(i: int) -> torch.Tensor:
    """A fresh 3x224x224 float32 tensor, made as cheaply as possible (a fill)."""
    return torch.full((3, CROP, CROP), float(i % 251))


def tiny(i: int) -> torch.Tensor:
    """An int to a 4-float tensor: almost no work, so per-element overhead is all there is."""
    return torch.tensor([i, i + 1, i + 2, i + 3], dtype=torch.float32) * 0.5


class Tokenize:
    """Document ``i`` tokenized by greedy longest-match word pieces, in pure Python (GIL-bound)."""

    def __init__(self, docs: list[str], vocab: list[str]) -> None:
        self.docs = docs
        self.ids = {piece: k for k, piece in enumerate(vocab)}
        self.longest = max(len(piece) for piece in vocab)

    def __call__(self, i: int) -> torch.Tensor:
        out = [self.ids["[CLS]"]]
        for word in self.docs[i % len(self.docs)].lower().split():
            stripped = word.rstrip(".,;!")
            out.extend(self._pieces(stripped))
            if len(stripped) < len(word):
                out.append(self.ids[word[len(stripped)]])
        return torch.tensor(out, dtype=torch.int64)

    def _pieces(self, word: str) -> list[int]:
        pieces, start = [], 0
        while start < len(word):
            end = min(len(word), start + self.longest)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    break
                end -= 1
            if end == start:
                return pieces + [self.ids["[UNK]"]]
            pieces.append(self.ids[piece])
            start = end
        return pieces


RECORD_BLOB_BYTES = (16 * 1024, 64 * 1024)
RECORD_FEATURES = 16
_RECORD_TAGS = ("train", "val", "en", "de", "fr", "photo", "scan", "synthetic")


class Records:
    """Row ``i`` of a table of records, shaped like a Hugging Face datasets or WebDataset row.

    An id string, an int label, 16 float32 features, a ``bytes`` blob of 16-64 KB (an encoded
    image or audio clip, not decoded here) and a nested dict of metadata. Everything is cut from
    buffers made once, so a row costs what building it costs: 7-10 us on the 2-core CI machine
    with a batch's rows alive together, the blobs' fresh pages included (``extra["item_us"]``).
    A loader's per-row overhead and the bytes it moves are most of what there is to measure.
    """

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        self.features = rng.standard_normal((1024, RECORD_FEATURES), dtype=np.float32)

    def __call__(self, i: int) -> dict[str, Any]:
        # A multiplicative hash of i: sizes and offsets vary from row to row, the same every run,
        # without the cost of a random generator per row.
        h = (i * 2654435761) & 0xFFFFFFFF
        low, high = RECORD_BLOB_BYTES
        size = low + h % (high - low + 1)
        start = (h >> 8) % (len(self.pool) - size)
        tags = [_RECORD_TAGS[i % len(_RECORD_TAGS)], _RECORD_TAGS[h % len(_RECORD_TAGS)]]
        return {
            "id": f"row-{i:08d}",
            "label": i % 1000,
            "features": self.features[i % len(self.features)].copy(),
            "blob": self.pool[start : start + size],
            "meta": {"len": size, "tags": tags},
        }


BLOB_BYTES = 64 * 1024
BLOB_FEATURES = 32


class Blob:
    """Sample ``i`` of the ``blobs`` workload: a dict as a new user's map-style dataset returns it.

    A short string id, 32 float32 features, a 64 KB ``bytes`` payload and a small nested dict
    (issue #33). The payload is a slice of a buffer made once, so a sample costs a 64 KB copy and
    little else: a cheap producer of large elements, whose batches (2 MB at 32 a batch) cost far
    more to move between processes than to make.
    """

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        self.features = rng.standard_normal((1024, BLOB_FEATURES), dtype=np.float32)

    def __call__(self, i: int) -> dict[str, Any]:
        # the same every run
        start = ((i * 2654435761) & 0xFFFFFFFF) % (len(self.pool) - BLOB_BYTES)
        return {
            "id": f"s{i:05d}",
            "features": self.features[i % len(self.features)].copy(),
            "payload": self.pool[start : start + BLOB_BYTES],
            "meta": {"index": i, "split": "train"},
        }


def pad_collate(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded with 0 to the longest sequence in the batch, and the true lengths."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    return torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True), lengths


_RECORD = struct.Struct("<qi29f")


class ShardReader:
    """Reads a shard file ``records_per_read`` records per request, each request ``delay_s`` late.

    The delay models remote storage (an object store's first-byte latency); records are parsed
    in Python into a feature tensor and a label.
    """

    def __init__(self, delay_s: float, records_per_read: int) -> None:
        self.delay_s, self.records_per_read = delay_s, records_per_read

    def __call__(self, path: str) -> Iterator[tuple[torch.Tensor, int]]:
        with open(path, "rb") as f:
            while True:
                time.sleep(self.delay_s)
                block = f.read(_RECORD.size * self.records_per_read)
                if not block:
                    return
                for offset in range(0, len(block), _RECORD.size):
                    _, label, *features = _RECORD.unpack_from(block, offset)
                    yield torch.tensor(features), label


class Shards(torch.utils.data.IterableDataset):
    """The DataLoader side of ``latency``: each worker reads its share of the shards, forever."""

    def __init__(self, paths: list[str], reader: ShardReader) -> None:
        self.paths, self.reader = paths, reader

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = torch.utils.data.get_worker_info()
        mine = self.paths if info is None else self.paths[info.id :: info.num_workers]
        while True:
            for path in mine:
                yield from self.reader(path)


class ShardPipeline:
    """The torchpipe side of ``latency``: a shard path to a pipeline over its records."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader

    def __call__(self, path: str) -> tp.Dataset:
        return tp.from_iterable(lambda: self.reader(path))


# -- workloads ----------------------------------------------------------------------------------
@dataclass
class Workload:
    """One workload: what DataLoader gets, what torchpipe gets, how to count, what the limit is.

    Attributes:
        pipeline: ``pipeline(num_parallel_calls, executor)`` -> an unbatched ``tp.Dataset``
            doing the same per-item work as ``dataset``.
        count: a batch -> (items, units of ``unit``).
        tp_grid: explicit knobs ``(num_parallel_calls, executor)`` tried for ``torchpipe_best``.
        limit: the physical limit in ``unit`` (None where there is no meaningful one).
        limit_note: how ``limit`` was obtained.
    """

    name: str
    unit: str
    batch_size: int
    dataset: torch.utils.data.Dataset
    pipeline: Callable[[Any, str], tp.Dataset]
    count: Callable[[Any], tuple[int, float]]
    tp_grid: list[tuple[Any, str]]
    collate_fn: Callable[[list[Any]], Any] | None = None
    limit: float | None = None
    limit_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    """The files the item function reads (tf.data's native pipeline reads them with its own ops)."""
    epochs: int = 0
    """Whole epochs measured on one loader, workers persistent (0: a timed window instead)."""
    auto_dataset: torch.utils.data.Dataset | None = None
    """The dataset ``torchpipe_dataloader_auto`` loads (None: ``dataset``): the training-transform
    workloads give it the same dataset with ``tp.image`` inside (``bench/training.py``)."""
    not_measured: dict[str, str] = field(default_factory=dict)
    """Rows the workload has no measurement of, and why (a peer its rows need is not installed)."""

    def loader_kwargs(self, num_workers: int | str = 0) -> dict[str, Any]:
        """The DataLoader arguments every DataLoader configuration with ``num_workers`` shares:
        ``persistent_workers=True`` where the workload measures epochs and there are workers."""
        kwargs: dict[str, Any] = {"batch_size": self.batch_size}
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        if self.epochs and num_workers != 0:
            kwargs["persistent_workers"] = True
        return kwargs

    def batched(self, parallel: Any, executor: str) -> tp.Dataset:
        """``pipeline(...)`` batched like the DataLoader's batches (same size, same collation)."""
        return self.pipeline(parallel, executor).batch(self.batch_size, collate_fn=self.collate_fn)


def _leading(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0])


def _count_items(batch: Any) -> tuple[int, float]:
    n = _leading(batch)
    return n, float(n)


def _count_rows(batch: dict[str, Any]) -> tuple[int, float]:
    n = int(batch["label"].shape[0])
    return n, float(n)


def _count_samples(batch: dict[str, Any]) -> tuple[int, float]:
    n = len(batch["id"])
    return n, float(n)


def _count_gigabytes(batch: torch.Tensor) -> tuple[int, float]:
    return int(batch.shape[0]), batch.numel() * batch.element_size() / 1e9


def _count_tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, float]:
    return int(batch[1].shape[0]), float(batch[1].sum())


def _mapped_pipeline(fn: Callable[[int], Any], length: int) -> Callable[[Any, str], tp.Dataset]:
    def build(parallel: Any, executor: str) -> tp.Dataset:
        return tp.from_dataset(range(length)).map(fn, parallel, executor=executor)

    return build


def _map_grid(inline: bool = False) -> list[tuple[Any, str]]:
    cores = usable_cpu_count()
    counts = [cores, 2 * cores]
    grid: list[tuple[Any, str]] = [(None, "thread")] if inline else []
    return grid + [(n, executor) for executor in ("thread", "process") for n in counts]


def _mapped(
    name: str,
    unit: str,
    batch: int,
    fn: Callable[[int], Any],
    length: int,
    grid: list[tuple[Any, str]],
    count: Callable[[Any], tuple[int, float]] = _count_items,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Workload:
    return Workload(
        name, unit, batch, Mapped(fn, length), _mapped_pipeline(fn, length), count, grid, collate_fn
    )


def jpeg(sizes: Sizes, quick: bool) -> Workload:
    """Decode a ~320 px JPEG with Pillow, random 224 crop, random flip; batch 64; img/s."""
    paths = data.jpeg_files(sizes.jpeg_files)
    work = _mapped("jpeg", "img/s", 64, JpegSample(paths), 10**7, _map_grid())
    work.files = paths
    _set_core_limit(work, JpegSample(paths), sizes.limit_s)
    work.extra["mean_jpeg_bytes"] = round(data.jpeg_bytes_per_file(paths))
    return work


def bigtensor(sizes: Sizes, quick: bool) -> Workload:
    """A 3x224x224 float32 fill per element; batch 64; GB/s (the IPC-bound case)."""
    work = _mapped("bigtensor", "GB/s", 64, big_tensor, 10**7, _map_grid(), _count_gigabytes)
    work.limit = memcpy_gbps(64 * 3 * CROP * CROP * 4, sizes.limit_s)
    work.limit_note = "memcpy of one batch (one core, best of three)"
    return work


def tiny_elements(sizes: Sizes, quick: bool) -> Workload:
    """An int to a 4-float tensor; batch 256; elem/s (the per-element-overhead case).

    At least ``TIMED_ELEMENTS`` elements, whatever ``sizes.tiny_elements`` says: the fastest rows
    (65k elem/s on 2 cores, twice that on a faster machine) must not reach the end inside their
    warm-up and window (issue #57)."""
    length = max(sizes.tiny_elements, TIMED_ELEMENTS)
    work = _mapped("tiny", "elem/s", 256, tiny, length, _map_grid(inline=True))
    _set_core_limit(work, tiny, sizes.limit_s)
    return work


TIMED_ELEMENTS = 10**7
"""The elements of a timed workload's data set: ~150 s at 65k elements/s, far past any window."""


def records(sizes: Sizes, quick: bool) -> Workload:
    """Dict rows (id, label, features, a 16-64 KB blob, nested metadata); batch 32; rows/s.

    The cheap-records case: each row costs under 20 us to make and carries ~40 KB of bytes, so
    moving rows between processes and collating them is most of the cost. torch's
    ``default_collate`` and torchpipe's ``batch`` make the same dict of lists and tensors (torch
    turns the nested tag lists into tuples, torchpipe keeps them lists).
    """
    work = _mapped(
        "records", "rows/s", 32, Records(data.SEED), 10**7, _map_grid(inline=True), _count_rows
    )
    _set_core_limit(work, Records(data.SEED), sizes.limit_s)
    work.extra["item_us"] = round(
        item_seconds(Records(data.SEED), work.batch_size, sizes.limit_s) * 1e6, 2
    )
    return work


def blobs(sizes: Sizes, quick: bool) -> Workload:
    """Dict samples with a 64 KB ``bytes`` payload, short epochs, persistent workers; batch 32; samples/s.

    Issue #33's case, tried as a new user would: ``sizes.blob_samples`` samples an epoch
    (``Blob``), default collate, ``sizes.epochs`` epochs on one loader. Each epoch is measured
    whole, so a loader's first decision and whether it revises it show epoch by epoch.
    """
    blob = Blob(data.SEED)
    # tp_grid: the parallelism the peers are tried at (torchpipe_best is not measured on epochs)
    work = Workload(
        "blobs",
        "samples/s",
        32,
        Mapped(blob, sizes.blob_samples),
        _mapped_pipeline(blob, sizes.blob_samples),
        _count_samples,
        _map_grid(),
        epochs=sizes.epochs,
    )
    _set_core_limit(work, blob, sizes.limit_s)
    work.extra["item_us"] = round(item_seconds(blob, work.batch_size, sizes.limit_s) * 1e6, 2)
    work.extra["epochs"] = sizes.epochs
    work.extra["samples_per_epoch"] = sizes.blob_samples
    return work


def text(sizes: Sizes, quick: bool) -> Workload:
    """Pure-Python tokenization, padded to the longest in the batch; batch 32; tokens/s."""
    docs, vocab = data.text_corpus(sizes.text_docs)
    work = _mapped(
        "text",
        "tokens/s",
        32,
        Tokenize(docs, vocab),
        10**7,
        _map_grid(),
        _count_tokens,
        pad_collate,
    )
    _set_core_limit(work, Tokenize(docs, vocab), sizes.limit_s)
    return work


LATENCY_S = 0.005
RECORDS_PER_READ = 16


def latency_grid(quick: bool) -> list[tuple[Any, str]]:
    """Reads in flight (interleave's cycle_length = num_parallel_calls) and executor tried."""
    counts = [16, 64] if quick else [8, 16, 32, 64]
    return [(n, "thread") for n in counts] + [(16, "process")]


def latency(sizes: Sizes, quick: bool) -> Workload:
    """64 shards read with 5 ms per request, records parsed, interleaved; batch 64; records/s."""
    paths = data.record_shards(sizes.shard_records)
    reader = ShardReader(LATENCY_S, RECORDS_PER_READ)
    opener = ShardPipeline(reader)

    def pipeline(parallel: Any, executor: str) -> tp.Dataset:
        files = tp.from_iterable(paths).repeat()
        cycle = tp.AUTOTUNE if parallel is None else parallel
        return files.interleave(
            opener, cycle_length=cycle, num_parallel_calls=parallel, executor=executor
        )

    work = Workload(
        "latency",
        "records/s",
        64,
        Shards(paths, reader),
        pipeline,
        _count_items,
        latency_grid(quick),
    )
    io_limit = len(paths) * RECORDS_PER_READ / LATENCY_S
    undelayed = ShardReader(0.0, RECORDS_PER_READ)
    records = itertools.chain.from_iterable(undelayed(path) for path in itertools.cycle(paths))
    cpu_limit = _inline_rate(lambda: records, 64, _count_items, sizes.limit_s) * usable_cpu_count()
    work.limit = min(io_limit, cpu_limit)
    work.limit_note = (
        f"min(64 reads in flight x {RECORDS_PER_READ} records / {LATENCY_S * 1e3:g} ms = "
        f"{io_limit:.0f}, parse rate without delay x {usable_cpu_count()} cores = {cpu_limit:.0f})"
    )
    return work


def cache(sizes: Sizes, quick: bool) -> Workload:
    """The ``jpeg`` pipeline with ``cache()`` after decode, one epoch at a time; img/s.

    ``dataset`` is one epoch of the uncached ``jpeg`` work (the DataLoader baselines);
    ``pipeline`` decodes on ``parallel`` workers, caches the decoded images in memory and
    crops and flips on threads, so epoch 2 replays decoded images instead of decoding again.
    """
    paths = data.jpeg_files(sizes.cache_files)
    decode = DecodeJpeg(paths)

    def pipeline(parallel: Any, executor: str) -> tp.Dataset:
        decoded = (
            tp.from_dataset(range(len(paths))).map(decode, parallel, executor=executor).cache()
        )
        return decoded.map(augment, parallel, executor="thread")

    work = Workload(
        "cache",
        "img/s",
        64,
        Mapped(JpegSample(paths), len(paths)),
        pipeline,
        _count_items,
        _map_grid(),
        files=paths,
    )
    decoded = [decode(i) for i in range(min(len(paths), 64))]
    replay = (augment(*decoded[i % len(decoded)]) for i in range(10**9))
    rate = _inline_rate(lambda: replay, work.batch_size, work.count, sizes.limit_s)
    work.limit = rate * usable_cpu_count()
    work.limit_note = (
        f"one core's rate of crop, flip and collation of decoded images ({rate:.0f}) x cores"
    )
    return work


# -- limits ------------------------------------------------------------------------------------
def _set_core_limit(work: Workload, fn: Callable[[int], Any], seconds: float) -> None:
    cores = usable_cpu_count()
    items = (fn(i) for i in range(10**9))
    rate = _inline_rate(lambda: items, work.batch_size, work.count, seconds, work.collate_fn)
    work.limit = rate * cores
    work.limit_note = (
        f"one core's rate of the item work and collation, no loader ({rate:.0f}) x {cores} cores"
    )


def _inline_rate(
    make: Callable[[], Any],
    batch: int,
    count: Callable[[Any], tuple[int, float]],
    seconds: float,
    collate: Callable[[list[Any]], Any] | None = None,
) -> float:
    """Units per second of building batches in a plain loop on one core (after one warm batch),
    the best of three windows: a burst of other work on a shared machine only lowers a window."""
    collate = collate or torch.utils.data.default_collate
    source = iter(make())
    collate([next(source) for _ in range(batch)])
    best = 0.0
    for _ in range(3):
        units, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            units += count(collate([next(source) for _ in range(batch)]))[1]
        best = max(best, units / (time.perf_counter() - t0))
    return best


def item_seconds(
    fn: Callable[[int], Any],
    batch: int,
    seconds: float,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds of one ``fn(i)`` on one core, ``batch`` results alive at once as in a batch being
    built (so fresh memory is paid for as a loader pays for it), no collation; best of three.
    ``clock`` reads the time (``time.thread_time``: the CPU time the calls took, whatever else
    the machine runs meanwhile)."""
    rows = [fn(i) for i in range(batch)]
    best, start = math.inf, batch
    for _ in range(3):
        calls, t0 = 0, clock()
        while clock() - t0 < seconds / 3:
            del rows
            rows = [fn(i) for i in range(start, start + batch)]
            calls, start = calls + batch, start + batch
        best = min(best, (clock() - t0) / calls)
    return best


def memcpy_gbps(nbytes: int, seconds: float) -> float:
    """GB/s of copying ``nbytes`` between two preallocated buffers on one core, best of three."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = 0.0
    for _ in range(3):
        copies, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            np.copyto(dst, src)
            copies += 1
        best = max(best, copies * nbytes / (time.perf_counter() - t0) / 1e9)
    return best

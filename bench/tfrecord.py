"""The ``tfrecord`` workload: issue #22's seed pipeline on shards of ``tf.train.Example`` records
holding a JPEG and a label (list_files + interleave + parse + decode + crop + batch), against
torch's DataLoader over the equivalent map-style dataset (``tp.io.TFRecordRecords``) and the
peers (``bench/peers.py``; tf.data's native pipeline reads the same files with its own ops,
``bench/tfdata.py``). Raw record reading without decode is reported in GB/s next to ``cat`` of
the same files.
"""

from __future__ import annotations

import io
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

import torchpipe as tp
from bench import data
from bench import workloads as wl

SHARDS = 8
CYCLE = 8
SPEC = {"image": tp.io.FixedLenFeature([], bytes), "label": tp.io.FixedLenFeature([], torch.int64)}


def tfrecord_shards(jpeg_count: int) -> list[str]:
    """``SHARDS`` TFRecord files of Examples ``{image: JPEG bytes, label: int}``, made once from
    the ``jpeg`` workload's files (record ``i`` holds file ``i``, label ``i % 1000``)."""
    jpegs = data.jpeg_files(jpeg_count)
    root = data._materialize(f"tfrecord-v1-{jpeg_count}", lambda tmp: _write_shards(tmp, jpegs))
    return [str(root / f"train-{k:05d}-of-{SHARDS:05d}.tfrecord") for k in range(SHARDS)]


def _write_shards(directory: Path, jpegs: list[str]) -> None:
    for k in range(SHARDS):
        with tp.io.TFRecordWriter(directory / f"train-{k:05d}-of-{SHARDS:05d}.tfrecord") as writer:
            for i in range(k, len(jpegs), SHARDS):
                writer.write(
                    tp.io.serialize_example(
                        {"image": Path(jpegs[i]).read_bytes(), "label": i % 1000}
                    )
                )


class ParseDecodeCrop:
    """A record to ``(CHW uint8 crop, label)``: parse the Example, decode the JPEG with Pillow,
    random 224 crop and flip (the ``jpeg`` workload's augmentation)."""

    def __call__(self, record: bytes) -> tuple[torch.Tensor, int]:
        parsed = tp.io.parse_single_example(record, SPEC)
        with Image.open(io.BytesIO(parsed["image"])) as image:
            pixels = np.asarray(image.convert("RGB"))
        return wl.augment(pixels, int(parsed["label"]))


class RecordSample:
    """The DataLoader's item ``i``: record ``i % n`` of the shards, parsed, decoded, cropped."""

    def __init__(self, records: tp.io.TFRecordRecords) -> None:
        self.records, self.work = records, ParseDecodeCrop()

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.work(self.records[i % len(self.records)])


def pipeline_builder(pattern: str) -> Callable[[Any, str], tp.Dataset]:
    """The seed pipeline (unbatched): shards interleaved 8 at a time, parsed, decoded, cropped."""

    def build(parallel: Any, executor: str) -> tp.Dataset:
        files = tp.list_files(pattern).repeat()
        reads = tp.AUTOTUNE if parallel is not None else None
        records = files.interleave(tp.TFRecordDataset, cycle_length=CYCLE, num_parallel_calls=reads)
        return records.map(ParseDecodeCrop(), parallel, executor=executor)

    return build


def raw_read_gbps(paths: list[str], seconds: float) -> dict[str, float]:
    """GB/s of reading every record without decoding (CRCs verified, page cache warm), best of
    three windows: ``reader`` is ``tp.TFRecordDataset`` alone (the optimizer's injected
    prefetch off: the reader's own speed), ``batched`` the default pipeline
    ``tp.TFRecordDataset(paths).batch(64)`` (elements cross the injected prefetch's thread a
    batch at a time)."""
    total = sum(os.path.getsize(p) for p in paths)
    alone = tp.Options(optimizations={"inject_prefetch": False})

    def rate(make: Callable[[], tp.Dataset]) -> float:
        def once() -> int:
            for _ in make():
                pass
            return total

        return round(_best_rate(once, seconds), 2)

    return {
        "reader": rate(lambda: tp.TFRecordDataset(paths).with_options(alone)),
        "batched": rate(lambda: tp.TFRecordDataset(paths).batch(64)),
    }


def cat_gbps(paths: list[str], seconds: float) -> float:
    """GB/s of ``cat`` of the same files to /dev/null, best of three windows."""
    total = sum(os.path.getsize(p) for p in paths)

    def once() -> int:
        subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)
        return total

    return _best_rate(once, seconds)


def _best_rate(read: Callable[[], int], seconds: float) -> float:
    read()  # warm the page cache
    best = 0.0
    for _ in range(3):
        done, t0 = 0, time.perf_counter()
        while True:
            done += read()
            if time.perf_counter() - t0 >= seconds / 3:
                break
        best = max(best, done / (time.perf_counter() - t0) / 1e9)
    return best


def tfrecord(sizes: wl.Sizes, quick: bool) -> wl.Workload:
    """The seed pipeline of issue #22 on TFRecord shards of JPEG Examples; batch 64; img/s."""
    paths = tfrecord_shards(sizes.jpeg_files)
    pattern = str(Path(paths[0]).parent / "train-*.tfrecord")
    records = tp.io.TFRecordRecords(paths)
    work = wl.Workload(
        "tfrecord",
        "img/s",
        64,
        wl.Mapped(RecordSample(records), 10**7),
        pipeline_builder(pattern),
        wl._count_items,
        wl._map_grid(),
    )
    wl._set_core_limit(work, RecordSample(records), sizes.limit_s)
    work.files = paths
    raw = raw_read_gbps(paths, sizes.limit_s)
    work.extra["raw_reader_gbps"], work.extra["raw_batched_gbps"] = raw["reader"], raw["batched"]
    work.extra["cat_gbps"] = round(cat_gbps(paths, sizes.limit_s), 2)
    work.extra["shard_mb"] = round(sum(os.path.getsize(p) for p in paths) / 1e6, 1)
    return work

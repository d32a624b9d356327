"""The training-transform workloads: ``train_jpeg`` and ``train_tfrecord`` (issue #61).

The transform image models train with, RandomResizedCrop to 224 (scale 0.08-1, ratio 3/4-4/3), a
random flip, normalized float CHW, batch 64, over photo-like JPEGs of ImageNet's size (about 500 x
375, quality 90: ``bench/data.py``'s ``photo_jpeg_files``), read as files (``train_jpeg``) or from
TFRecord shards of the same photos (``train_tfrecord``, the seeds' pipeline). The rows are built
from ``bench/train_transform.py``'s, in ``bench/run.py``'s verdict machinery:

- torch's DataLoader grid (``dataloader_default``, ``dataloader_best``, its twins) and the peers
  over the torchvision-style dataset: Pillow's decode and torchvision's transform (or the same
  operations on Pillow, ``PillowTrainTransform``, where torchvision does not import);
- ``torchpipe_dataloader_auto``: ``tp.DataLoader(num_workers="auto")`` over the same dataset with
  ``tp.image.train_transform`` inside (``Workload.auto_dataset``);
- ``torchpipe_tpimage``: the DSL with ``tp.image`` as docs/image.md writes it (:data:`PIPELINES`);
- ``tfdata_native``: TensorFlow's decode-and-crop recipe (``train_transform.tf_dataset``);
- FFCV's RandomResizedCrop pipeline is measured by ``bench/train_transform.py`` (``ffcv``) where
  FFCV is installed; here it is listed under ``not_measured`` with why.

They are not in ``bench/run.py``'s default list (``bench/suite.py``'s ``DEFAULT``): run them with
``python bench/run.py --quick --repeat 3 --workloads train_jpeg,train_tfrecord``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torchpipe as tp
from bench import data
from bench import train_transform as tt
from bench import workloads as wl

KINDS = {"train_jpeg": "jpeg", "train_tfrecord": "tfrecord"}
"""Each workload and what ``bench/train_transform.py`` calls its data (files or shards)."""
FFCV_ROW = "ffcv"
FFCV_ELSEWHERE = (
    "FFCV's RandomResizedCrop pipeline (uint8 out: it does less) has no peer configuration here: "
    "bench/train_transform.py --rows ffcv measures it"
)


def _pipeline(kind: str) -> Callable[[list[str]], tp.Dataset]:
    def build(files: list[str]) -> tp.Dataset:
        return tt.tpimage_items(kind, files)

    return build


PIPELINES: dict[str, Callable[[list[str]], tp.Dataset]] = {
    name: _pipeline(kind) for name, kind in KINDS.items()
}
"""``torchpipe_tpimage``'s unbatched pipeline over ``work.files`` (the photos) by workload
(``bench/tpimage.py``'s ``batched`` batches and prefetches it)."""


def native(work: wl.Workload) -> Any:
    """``tfdata_native``'s ``tf.data.Dataset`` on ``work`` (``bench/tfdata.py``'s native rows)."""
    return tt.tf_dataset(KINDS[work.name], work.files, work.batch_size)


def _ffcv_missing() -> dict[str, str]:
    """``not_measured``'s FFCV entry: not installed, or measured by ``bench/train_transform.py``."""
    if importlib.util.find_spec("ffcv") is None:
        return {FFCV_ROW: "ffcv is not installed"}
    return {FFCV_ROW: FFCV_ELSEWHERE}


def _workload(name: str, sizes: wl.Sizes, items: tuple[Any, Any], files: list[str]) -> wl.Workload:
    """A training-transform workload: ``items`` (the torchvision-style item, the same with
    ``tp.image``) over 10^7 indices, its limit one core's rate of the torchvision-style item."""
    pillow, tp_image = items
    length = wl.TIMED_ELEMENTS
    pipeline = wl._mapped_pipeline(pillow, length)
    work = wl.Workload(
        name, "img/s", 64, wl.Mapped(pillow, length), pipeline, wl._count_items, wl._map_grid()
    )
    work.files = files
    work.auto_dataset = wl.Mapped(tp_image, length)
    work.not_measured = _ffcv_missing()
    wl._set_core_limit(work, pillow, sizes.limit_s)
    work.extra["photos"] = len(files)
    return work


def _photos(sizes: wl.Sizes) -> list[str]:
    return data.photo_jpeg_files(sizes.photo_files or sizes.jpeg_files)


def train_jpeg(sizes: wl.Sizes, quick: bool) -> wl.Workload:
    """RandomResizedCrop 224, flip, normalize of photo-like JPEG files; batch 64; img/s."""
    files = _photos(sizes)
    return _workload("train_jpeg", sizes, (tt.PillowTrainItem(files), tt.TpImageItem(files)), files)


def train_tfrecord(sizes: wl.Sizes, quick: bool) -> wl.Workload:
    """The same transform on TFRecord shards of the same photos (the seeds' pipeline); img/s."""
    files = _photos(sizes)
    shards = tt.tfrecord_shards(files)
    work = _workload(
        "train_tfrecord", sizes, (tt.PillowRecordItem(shards), tt.TpImageRecordItem(shards)), files
    )
    work.extra["shards"] = len(shards)
    return work

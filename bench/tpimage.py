"""The ``torchpipe_tpimage`` configuration: the ``jpeg`` and ``tfrecord`` workloads' work in
``tp.image``'s ops, zero knobs (issue #34).

The item is the workloads' own (decode to RGB, a random 224 crop, a random flip, CHW uint8, the
label), done with ``tp.image.decode_jpeg``, ``random_crop``, ``random_flip_left_right`` and
``to_tensor`` (libjpeg-turbo, torch and numpy kernels, without the GIL) instead of Pillow and
numpy, with ``num_parallel_calls=tp.AUTOTUNE`` and ``prefetch(tp.AUTOTUNE)`` everywhere: the
pipeline a user writes with ``tp.image``. It is held to tf.data's native pipeline (TensorFlow's own
``decode_jpeg`` and ``random_crop``, ``bench/targets.py``), and decodes as it does: with
libjpeg-turbo's fast integer IDCT (``fast_dct=True``; ``tf.io.decode_jpeg``'s default), so the
two make the same pixels, bit for bit. ``tp.image``'s default, the accurate IDCT (Pillow's pixels),
costs ~5% more CPU per image (bench/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import torchpipe as tp
from bench import tfrecord
from bench import workloads as wl

CONFIG = "torchpipe_tpimage"


def crop_and_flip(image: torch.Tensor) -> torch.Tensor:
    """The workloads' augmentation on a decoded HWC image: a random 224 crop, a random flip, CHW."""
    crop = tp.image.random_flip_left_right(tp.image.random_crop(image, wl.CROP))
    return tp.image.to_tensor(crop, dtype=torch.uint8)


class JpegItem:
    """File ``i % len(paths)`` decoded, cropped and flipped with ``tp.image``, and its label."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        return crop_and_flip(
            tp.image.decode_jpeg(self.paths[i % len(self.paths)], fast_dct=True)
        ), i % 1000


def parse_decode_crop(record: bytes) -> tuple[torch.Tensor, int]:
    """A ``tf.train.Example`` record to (CHW uint8 crop, label) with ``tp.image``."""
    parsed = tp.io.parse_single_example(record, tfrecord.SPEC)
    return crop_and_flip(tp.image.decode_jpeg(parsed["image"], fast_dct=True)), int(parsed["label"])


def jpeg_pipeline(paths: list[str]) -> tp.Dataset:
    return tp.range(10**7).map(JpegItem(paths), num_parallel_calls=tp.AUTOTUNE)


def tfrecord_pipeline(paths: list[str]) -> tp.Dataset:
    """The seed pipeline with ``tp.image``: shards interleaved 8 at a time, parsed, decoded, cropped."""
    files = tp.from_iterable(paths).repeat()
    records = files.interleave(
        tp.TFRecordDataset, cycle_length=tfrecord.CYCLE, num_parallel_calls=tp.AUTOTUNE
    )
    return records.map(parse_decode_crop, num_parallel_calls=tp.AUTOTUNE)


PIPELINES: dict[str, Callable[[list[str]], tp.Dataset]] = {
    "jpeg": jpeg_pipeline,
    "tfrecord": tfrecord_pipeline,
}
"""The workloads with a ``tp.image`` configuration: the unbatched pipeline over ``work.files``."""


def batched(work: wl.Workload) -> tp.Dataset | None:
    """``work``'s ``tp.image`` pipeline, batched and prefetched as a user would; None where it has none."""
    build = PIPELINES.get(work.name)
    if build is None:
        return None
    return build(work.files).batch(work.batch_size).prefetch(tp.AUTOTUNE)

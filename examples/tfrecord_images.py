"""tf.data's classic image pipeline, in torchpipe with ``tp.image``: TFRecord shards of
``tf.train.Example`` records -> interleave -> parse, decode, crop, flip, normalize -> batch -> prefetch.

Run: python examples/tfrecord_images.py [--files 'train-*.tfrecord'] [--batches N]

``--files`` is a glob of TFRecord shards whose Examples hold ``image/encoded`` (JPEG bytes) and
``image/class/label`` (int64), as TensorFlow's ImageNet conversion scripts write them; without it
a few shards of synthetic JPEGs are written (with ``tp.io``'s writer: the same bytes TensorFlow
writes) in a temporary directory. The same pipeline in tf.data reads::

    files = tf.data.Dataset.list_files(pattern, shuffle=True)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=AUTOTUNE)
    images = records.map(parse_decode_augment, num_parallel_calls=AUTOTUNE)
    batches = images.batch(64).prefetch(AUTOTUNE)
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time

import numpy as np
import torch
from PIL import Image

import torchpipe as tp

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CROP = 224
SPEC = {
    "image/encoded": tp.io.FixedLenFeature([], bytes),
    "image/class/label": tp.io.FixedLenFeature([], torch.int64),
}


def write_shards(directory: str, shards: int = 4, per_shard: int = 64) -> str:
    """Shards of Examples holding photo-like JPEGs of 256-400 px; returns their glob."""
    rng = np.random.default_rng(0)
    for k in range(shards):
        with tp.io.TFRecordWriter(
            os.path.join(directory, f"train-{k:05d}-of-{shards:05d}.tfrecord")
        ) as writer:
            for i in range(per_shard):
                w, h = (int(v) for v in rng.integers(256, 401, size=2))
                coarse = rng.integers(0, 256, size=(5, 5, 3), dtype=np.uint8)
                encoded = io.BytesIO()
                Image.fromarray(coarse).resize((w, h), Image.BICUBIC).save(
                    encoded, "JPEG", quality=90
                )
                example = {
                    "image/encoded": encoded.getvalue(),
                    "image/class/label": (k * per_shard + i) % 10,
                }
                writer.write(tp.io.serialize_example(example))
    return os.path.join(directory, "train-*.tfrecord")


def parse_decode_augment(record: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """tf.io.parse_single_example, tf.io.decode_jpeg, tf.image.random_crop and
    random_flip_left_right, then normalized floats (CHW, as PyTorch models take them)."""
    example = tp.io.parse_single_example(record, SPEC)
    image = tp.image.decode_jpeg(example["image/encoded"])
    image = tp.image.random_flip_left_right(tp.image.random_crop(image, CROP))
    return tp.image.to_tensor(image, MEAN, STD), example["image/class/label"]


def pipeline(pattern: str, batch_size: int) -> tp.Dataset:
    files = tp.list_files(pattern, shuffle=True)
    records = files.interleave(tp.TFRecordDataset, cycle_length=4, num_parallel_calls=tp.AUTOTUNE)
    images = records.map(parse_decode_augment, num_parallel_calls=tp.AUTOTUNE)
    return images.batch(batch_size).prefetch(tp.AUTOTUNE).with_options(tp.Options(seed=0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", help="a glob of TFRecord shards; default: synthetic ones")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pattern = args.files or write_shards(tmp)
        ds = pipeline(pattern, args.batch_size)
        print(ds.explain())
        for epoch in range(args.epochs):
            it, images, start = iter(ds), 0, time.perf_counter()
            for x, y in it:
                assert x.shape[1:] == (3, CROP, CROP) and x.dtype == torch.float32
                images += len(y)
            seconds = time.perf_counter() - start
            print(
                f"epoch {epoch}: {images} images in {seconds:.2f} s ({images / seconds:.0f} img/s)"
            )
        print(it.stats())


if __name__ == "__main__":
    main()

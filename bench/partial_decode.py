"""What decoding only RandomResizedCrop's window would save, measured on the decode alone (#61).

No maintained package on PyPI hands libjpeg-turbo's partial decode (``jpeg_crop_scanline``,
``jpeg_skip_scanlines``, TurboJPEG 3's ``tj3SetCroppingRegion``) to Python (bench/RESULTS.md,
2026-12-04). TensorFlow's ``decode_and_crop_jpeg`` is built on it, so on the same files and the
same windows (drawn as torchvision's ``RandomResizedCrop`` draws them, scale 0.08-1, ratio
3/4-4/3) this compares, CPU time an image on one thread:

- ``simplejpeg`` full decode (accurate and fast IDCT), and at a 1/2 DCT scale (what
  ``tp.image`` does where the window is twice the output or more);
- TensorFlow's ``decode_jpeg`` of the whole image against ``decode_and_crop_jpeg`` of the
  window, and of the whole image as a window (the op's own cost, to read the difference by);
- the windows' mean share of the image's area, and of its rows down to the window's bottom
  (what a partial decode still entropy-decodes: libjpeg-turbo cannot skip Huffman data).

Run: ``python bench/partial_decode.py [--files N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the bench package from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import simplejpeg

import torchpipe as tp
from bench import data

Window = tuple[int, int, int, int]


def cpu_us(decode: Callable[[int], Any], count: int, reps: int) -> float:
    """Median over ``reps`` of the process's CPU microseconds per call of ``decode(i)``."""
    runs = []
    for _ in range(reps):
        start = time.process_time()
        for i in range(count):
            decode(i)
        runs.append((time.process_time() - start) / count * 1e6)
    return statistics.median(runs)


def windows(blobs: list[bytes], seed: int = 0) -> list[Window]:
    rng = np.random.default_rng(seed)
    out = []
    for blob in blobs:
        height, width, _, _ = simplejpeg.decode_jpeg_header(blob)
        out.append(tp.image.random_resized_crop_window(height, width, rng=rng))
    return out


def shares(blobs: list[bytes], wins: list[Window]) -> dict[str, float]:
    """The windows' mean share of the area, and of the rows down to their bottom edge."""
    area, rows = [], []
    for blob, (top, _, h, w) in zip(blobs, wins):
        height, width, _, _ = simplejpeg.decode_jpeg_header(blob)
        area.append(h * w / (height * width))
        rows.append((top + h) / height)
    return {
        "window_area_share": float(np.mean(area)),
        "rows_to_window_bottom": float(np.mean(rows)),
    }


def simplejpeg_rows(blobs: list[bytes], reps: int) -> dict[str, float]:
    def half(i: int) -> Any:
        height, width, _, _ = simplejpeg.decode_jpeg_header(blobs[i])
        return simplejpeg.decode_jpeg(
            blobs[i], colorspace="RGB", min_height=height // 2, min_width=width // 2
        )

    n = len(blobs)
    return {
        "simplejpeg_full_accurate_us": cpu_us(
            lambda i: simplejpeg.decode_jpeg(blobs[i], colorspace="RGB"), n, reps
        ),
        "simplejpeg_full_fast_dct_us": cpu_us(
            lambda i: simplejpeg.decode_jpeg(blobs[i], colorspace="RGB", fastdct=True), n, reps
        ),
        "simplejpeg_half_scale_us": cpu_us(half, n, reps),
    }


def tensorflow_rows(blobs: list[bytes], wins: list[Window], reps: int) -> dict[str, float]:
    """TensorFlow's decoders on one thread (its default IDCT, the fast one, both)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    encoded = [tf.constant(b) for b in blobs]
    crops = [tf.constant(w, dtype=tf.int32) for w in wins]
    full = [
        tf.constant([0, 0, *simplejpeg.decode_jpeg_header(b)[:2]], dtype=tf.int32) for b in blobs
    ]
    n = len(blobs)
    return {
        "tf_decode_jpeg_us": cpu_us(lambda i: tf.io.decode_jpeg(encoded[i], channels=3), n, reps),
        "tf_decode_and_crop_whole_us": cpu_us(
            lambda i: tf.io.decode_and_crop_jpeg(encoded[i], full[i], channels=3), n, reps
        ),
        "tf_decode_and_crop_window_us": cpu_us(
            lambda i: tf.io.decode_and_crop_jpeg(encoded[i], crops[i], channels=3), n, reps
        ),
    }


def measure(files: int, reps: int) -> dict[str, float]:
    blobs = [Path(p).read_bytes() for p in data.photo_jpeg_files(files)]
    wins = windows(blobs)
    results = shares(blobs, wins)
    results.update(simplejpeg_rows(blobs, reps))
    try:
        results.update(tensorflow_rows(blobs, wins, reps))
    except ImportError:
        pass  # no TensorFlow: no partial decode to measure
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=256, help="photo JPEGs (about 500 x 375)")
    parser.add_argument("--reps", type=int, default=5, help="repeats; the median is reported")
    args = parser.parse_args(argv)
    for name, value in measure(args.files, args.reps).items():
        print(
            f"{name}: {value:.3f}" if "share" in name or "rows" in name else f"{name}: {value:.0f}"
        )


if __name__ == "__main__":
    main()

"""Synthetic benchmark data, generated deterministically once into a cache directory.

Nothing is downloaded. Each data set lives in its own directory named after its version and
size (``jpeg-v1-512``); it is built in a temporary directory and renamed into place, so an
interrupted generation is never mistaken for a complete one. The cache directory is
``$TORCHPIPE_BENCH_CACHE`` or ``~/.cache/torchpipe-bench``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

CACHE_ENV = "TORCHPIPE_BENCH_CACHE"
SEED = 20240905

JPEG_QUALITY = 90
JPEG_SIDES = (288, 352)  # width and height are drawn from this range: "about 320 px"
PHOTO_SIDES = ((450, 550), (340, 410))  # ImageNet's typical photo: width, height about 500 x 375

RECORD_DTYPE = np.dtype([("id", "<i8"), ("label", "<i4"), ("x", "<f4", (29,))])  # 128 bytes
SHARDS = 64

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + [
    c + v + e for c in "bdklmnrst" for v in "aeiou" for e in "nrst"
]


def cache_dir() -> Path:
    """The directory holding every generated data set (created if missing)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "torchpipe-bench")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _materialize(name: str, build: Callable[[Path], None]) -> Path:
    """``cache_dir()/name``, built by ``build(tmp_dir)`` the first time and reused afterwards."""
    final = cache_dir() / name
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a concurrent run that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def jpeg_files(count: int) -> list[str]:
    """Paths of ``count`` JPEG files (about 320 px a side, quality 90), generated once."""
    root = _materialize(f"jpeg-v1-{count}", lambda tmp: _write_jpegs(tmp, count))
    return [str(root / f"{i:06d}.jpg") for i in range(count)]


def photo_jpeg_files(count: int) -> list[str]:
    """Paths of ``count`` JPEG files of ImageNet's typical size (about 500 x 375, ``PHOTO_SIDES``),
    quality 90, generated once: what a RandomResizedCrop training transform reads."""
    root = _materialize(f"jpeg-photo-v1-{count}", lambda tmp: _write_jpegs(tmp, count, PHOTO_SIDES))
    return [str(root / f"{i:06d}.jpg") for i in range(count)]


def _write_jpegs(
    directory: Path, count: int, sides: tuple[tuple[int, int], ...] | None = None
) -> None:
    from PIL import Image

    for i in range(count):
        pixels = _photo_like(np.random.default_rng([SEED, i]), sides)
        with open(directory / f"{i:06d}.jpg", "wb") as f:
            Image.fromarray(pixels).save(f, quality=JPEG_QUALITY)


def _photo_like(
    rng: np.random.Generator, sides: tuple[tuple[int, int], ...] | None = None
) -> np.ndarray:
    """An RGB image with smooth shapes and mild noise, so it compresses like a photo; width and
    height drawn from ``sides`` (their ranges), by default both from ``JPEG_SIDES``."""
    from PIL import Image

    if sides is None:
        width, height = (int(v) for v in rng.integers(*JPEG_SIDES, size=2, endpoint=True))
    else:
        width, height = (int(rng.integers(low, high, endpoint=True)) for low, high in sides)
    coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    smooth = np.asarray(
        Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16
    )
    noise = rng.integers(-10, 11, size=smooth.shape, dtype=np.int16)
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def jpeg_bytes_per_file(paths: list[str]) -> float:
    """Mean file size in bytes (printed with the machine description)."""
    return float(np.mean([os.path.getsize(p) for p in paths]))


def text_corpus(count: int) -> tuple[list[str], list[str]]:
    """``count`` synthetic documents and the tokenizer's vocabulary, generated once."""
    root = _materialize(f"text-v2-{count}", lambda tmp: _write_text(tmp, count))
    with open(root / "docs.txt", encoding="utf-8") as f:
        docs = f.read().split("\n")
    with open(root / "vocab.txt", encoding="utf-8") as f:
        vocab = f.read().split("\n")
    return docs, vocab


def _write_text(directory: Path, count: int) -> None:
    rng = np.random.default_rng([SEED, 1])
    lengths = rng.integers(1, 5, size=20_000)
    syllables = rng.integers(0, len(_SYLLABLES), size=(len(lengths), 4))
    words = ["".join(_SYLLABLES[k] for k in row[:n]) for row, n in zip(syllables, lengths)]
    # Zipf-like word frequencies, as in natural text: a few words are very common.
    cumulative = np.cumsum(1.0 / np.arange(1, len(words) + 1))
    cumulative /= cumulative[-1]
    docs = []
    for _ in range(count):
        picked = np.searchsorted(cumulative, rng.random(int(rng.integers(48, 400))))
        sentence = [words[k] for k in picked]
        for k in range(11, len(sentence), 12):
            sentence[k] += rng.choice([".", ",", ";", "!"])
        docs.append(" ".join(sentence).capitalize())
    vocab = ["[PAD]", "[UNK]", "[CLS]", ".", ",", ";", "!"] + words[:3000]
    vocab += _SYLLABLES + ["##" + s for s in _SYLLABLES]
    (directory / "docs.txt").write_text("\n".join(docs), encoding="utf-8")
    (directory / "vocab.txt").write_text("\n".join(vocab), encoding="utf-8")


def record_shards(records_per_shard: int) -> list[str]:
    """Paths of ``SHARDS`` files of fixed-size binary records (``RECORD_DTYPE``), made once."""
    root = _materialize(
        f"shards-v1-{records_per_shard}", lambda tmp: _write_shards(tmp, records_per_shard)
    )
    return [str(root / f"shard-{k:03d}.bin") for k in range(SHARDS)]


def _write_shards(directory: Path, records_per_shard: int) -> None:
    for k in range(SHARDS):
        rng = np.random.default_rng([SEED, 2, k])
        records = np.zeros(records_per_shard, RECORD_DTYPE)
        records["id"] = np.arange(records_per_shard) + k * records_per_shard
        records["label"] = rng.integers(0, 10, size=records_per_shard)
        records["x"] = rng.standard_normal((records_per_shard, 29), dtype=np.float32)
        (directory / f"shard-{k:03d}.bin").write_bytes(records.tobytes())

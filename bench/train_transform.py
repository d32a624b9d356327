"""The training transform image models train with, side by side (issue #61).

RandomResizedCrop to 224 (scale 0.08-1, ratio 3/4-4/3), a random flip, normalized float CHW,
batch 64, over ImageNet-sized photo-like JPEGs (``bench/data.py``'s ``photo_jpeg_files``, about
500 x 375, quality 90), read as files (``jpeg``) or from TFRecord shards (``tfrecord``):

- ``torchpipe_tpimage``: ``tp.image.train_transform`` in a DSL pipeline as docs/image.md writes
  it (shuffle, map AUTOTUNE, batch, prefetch AUTOTUNE), with libjpeg-turbo's fast IDCT as
  TensorFlow's decoders use by default; ``torchpipe_tpimage_unfused``, the same with the separate
  ops (``decode_and_random_resized_crop``, ``random_flip_left_right``, ``to_tensor``);
- ``torch_dataloader_torchvision_w<n>``: torch's DataLoader with ``n`` workers over a
  torchvision-style dataset (Pillow's decode, torchvision's ``RandomResizedCrop``,
  ``RandomHorizontalFlip``, ``ToTensor``, ``Normalize``); where torchvision does not import, the
  same operations written with Pillow and torch (``PillowTrainTransform``), as torchvision runs
  them on a Pillow image;
- ``tp_dataloader_auto``: ``tp.DataLoader(num_workers="auto")`` over the same dataset with
  ``tp.image.train_transform`` in ``__getitem__``;
- ``tfdata_native``: TensorFlow's own ops, as its ImageNet preprocessing: ``extract_jpeg_shape``,
  ``sample_distorted_bounding_box``, ``decode_and_crop_jpeg`` (only the window is decoded),
  antialiased bilinear ``resize``, ``random_flip_left_right``, normalize, CHW, AUTOTUNE everywhere;
- ``ffcv``: FFCV's ``RandomResizedCropRGBImageDecoder``, flip, uint8 CHW (it does less: no
  normalization, uint8 out), where FFCV is installed.

Each configuration runs in a fresh process, in alternating rounds (the order reversed every
round); a row is the median of the rounds' images a second and CPU time an image (the process
and its children). Run ``python bench/train_transform.py --quick``; ``--decode`` measures the
decode alone: full, at a DCT scale, and TensorFlow's decode of only the window.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the bench package from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import psutil
import torch

import torchpipe as tp
from bench import data
from bench import workloads as wl

SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
WORKLOADS = ("jpeg", "tfrecord")
SHARDS = 8
CYCLE = 8
# items in one epoch of the DataLoader rows (ImageNet's training set): files repeated
EPOCH = 1_281_167
TORCH_WORKERS = (2, 4)


def labels_of(count: int) -> list[int]:
    return [i % 1000 for i in range(count)]


def tfrecord_shards(files: list[str]) -> list[str]:
    """``SHARDS`` TFRecord files of Examples ``{image: JPEG bytes, label: int}`` of ``files``."""
    from bench.tfrecord import _write_shards

    root = data._materialize(
        f"tfrecord-photo-v1-{len(files)}", lambda tmp: _write_shards(tmp, files)
    )
    return sorted(str(p) for p in root.glob("*.tfrecord"))


# -- torchpipe ---------------------------------------------------------------------------------
def train_sample(data_: Any, label: Any) -> tuple[torch.Tensor, Any]:
    """docs/image.md's training transform, with TensorFlow's default (fast) IDCT."""
    return tp.image.train_transform(data_, SIZE, MEAN, STD, fast_dct=True), label


SPEC = {"image": tp.io.FixedLenFeature([], bytes), "label": tp.io.FixedLenFeature([], torch.int64)}


def unfused_train_sample(data_: Any, label: Any) -> tuple[torch.Tensor, Any]:
    """The same with ``tp.image``'s separate ops (before ``train_transform``): the same output."""
    image = tp.image.decode_and_random_resized_crop(data_, SIZE, SCALE, RATIO, fast_dct=True)
    return tp.image.to_tensor(tp.image.random_flip_left_right(image), MEAN, STD), label


def parse_train_sample(record: bytes) -> tuple[torch.Tensor, Any]:
    parsed = tp.io.parse_single_example(record, SPEC)
    return train_sample(parsed["image"], parsed["label"])


def parse_unfused_train_sample(record: bytes) -> tuple[torch.Tensor, Any]:
    parsed = tp.io.parse_single_example(record, SPEC)
    return unfused_train_sample(parsed["image"], parsed["label"])


def tpimage_items(workload: str, files: list[str], fused: bool = True) -> tp.Dataset:
    """``torchpipe_tpimage``'s pipeline before its batch: the photos (``jpeg``) or their TFRecord
    shards (``tfrecord``) through the training transform (``fused=False``: the separate ops)."""
    if workload == "jpeg":
        ds = tp.from_tensor_slices((files, labels_of(len(files)))).repeat().shuffle(len(files))
        return ds.map(
            train_sample if fused else unfused_train_sample, num_parallel_calls=tp.AUTOTUNE
        )
    shards = tp.from_tensor_slices(tfrecord_shards(files)).repeat()
    records = shards.interleave(
        tp.TFRecordDataset, cycle_length=CYCLE, num_parallel_calls=tp.AUTOTUNE
    )
    return records.map(
        parse_train_sample if fused else parse_unfused_train_sample, num_parallel_calls=tp.AUTOTUNE
    )


def tpimage(workload: str, files: list[str], batch_size: int, fused: bool = True) -> Iterable[Any]:
    """``torchpipe_tpimage``: the DSL pipeline docs/image.md shows (``_unfused``: with the
    separate ops)."""
    ds = (
        tpimage_items(workload, files, fused)
        .batch(batch_size, drop_remainder=True)
        .prefetch(tp.AUTOTUNE)
    )
    return ds.with_options(tp.Options(seed=0))


class PillowTrainTransform:
    """torchvision's RandomResizedCrop, RandomHorizontalFlip, ToTensor and Normalize on a Pillow
    image, written with Pillow and torch where torchvision does not import: the window drawn
    from torch's generator as ``RandomResizedCrop.get_params`` draws it (``tp.image``'s window
    function on numbers from torch), crop then antialiased ``BILINEAR`` resize, flip, /255,
    normalize."""

    def __call__(self, image: Any) -> torch.Tensor:
        from PIL import Image

        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        rng = np.random.default_rng(seed)
        top, left, h, w = tp.image.random_resized_crop_window(
            image.height, image.width, SCALE, RATIO, rng
        )
        crop = image.crop((left, top, left + w, top + h)).resize((SIZE, SIZE), Image.BILINEAR)
        if torch.rand(1).item() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(crop, np.uint8)).permute(2, 0, 1).float().div(255)
        return x.sub_(torch.tensor(MEAN).view(3, 1, 1)).div_(torch.tensor(STD).view(3, 1, 1))


def torchvision_transform() -> Callable[[Any], torch.Tensor]:
    """torchvision's training transform, or :class:`PillowTrainTransform` where it does not import."""
    try:
        from torchvision import transforms
    except Exception:  # noqa: BLE001 - not installed, or a build for another torch (RuntimeError)
        return PillowTrainTransform()
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(SIZE, SCALE, RATIO),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


class PillowTrainItem:
    """Item ``i`` of a torchvision-style dataset of (path, label): file ``i % len(files)`` opened
    with Pillow through torchvision's transform, and the label ``i % 1000``."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.transform = torchvision_transform()

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.files[i % len(self.files)]) as image:
            return self.transform(image.convert("RGB")), i % 1000


class TpImageItem(PillowTrainItem):
    """The same item with one line changed: ``tp.image.train_transform``."""

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        return train_sample(self.files[i % len(self.files)], i % 1000)


class PillowRecordItem:
    """Item ``i`` of the same dataset over TFRecord shards: record ``i % n`` parsed, its JPEG
    opened with Pillow through torchvision's transform, and its label."""

    def __init__(self, shards: list[str]) -> None:
        self.records = tp.io.TFRecordRecords(shards)
        self.transform = torchvision_transform()

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        parsed = tp.io.parse_single_example(self.records[i % len(self.records)], SPEC)
        with Image.open(io.BytesIO(parsed["image"])) as image:
            return self.transform(image.convert("RGB")), int(parsed["label"])


class TpImageRecordItem(PillowRecordItem):
    """The same record item with ``tp.image.train_transform``."""

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        image, label = parse_train_sample(self.records[i % len(self.records)])
        return image, int(label)


def folder(files: list[str], length: int = EPOCH) -> wl.Mapped:
    """A torchvision-style dataset of (path, label): Pillow and torchvision's transform."""
    return wl.Mapped(PillowTrainItem(files), length)


def tp_image_folder(files: list[str], length: int = EPOCH) -> wl.Mapped:
    """The same dataset with one line of ``__getitem__`` changed: ``tp.image.train_transform``."""
    return wl.Mapped(TpImageItem(files), length)


def torch_dataloader(files: list[str], batch_size: int, workers: int) -> Iterable[Any]:
    """``torch_dataloader_torchvision_w<workers>``."""
    return torch.utils.data.DataLoader(
        folder(files),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
    )


def tp_dataloader(files: list[str], batch_size: int) -> Iterable[Any]:
    """``tp_dataloader_auto``."""
    return tp.DataLoader(
        tp_image_folder(files),
        batch_size=batch_size,
        shuffle=True,
        num_workers="auto",
        drop_last=True,
    )


# -- TensorFlow ----------------------------------------------------------------------------------
def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def tf_train_sample(tf: Any, encoded: Any, label: Any) -> tuple[Any, Any]:
    """TensorFlow's ImageNet training preprocessing with torchvision's ranges: decode only the
    window ``sample_distorted_bounding_box`` draws, resize, flip, normalize, CHW."""
    shape = tf.io.extract_jpeg_shape(encoded)
    whole = tf.constant([0.0, 0.0, 1.0, 1.0], dtype=tf.float32, shape=[1, 1, 4])
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=whole,
        min_object_covered=0.0,
        aspect_ratio_range=RATIO,
        area_range=SCALE,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    top, left, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
    window = tf.stack([top, left, height, width])
    image = tf.io.decode_and_crop_jpeg(encoded, window, channels=3)
    image = tf.image.resize(image, (SIZE, SIZE), method="bilinear", antialias=True)
    image = tf.image.random_flip_left_right(image)
    image = (image / 255.0 - MEAN) / STD
    return tf.transpose(image, (2, 0, 1)), label


def tf_dataset(workload: str, files: list[str], batch_size: int) -> Any:
    """``tfdata_native``'s ``tf.data.Dataset``: the pipeline in TensorFlow's own ops, AUTOTUNE
    everywhere, over the photos (``jpeg``) or their TFRecord shards (``tfrecord``)."""
    tf = _tf()
    if workload == "jpeg":
        ds = (
            tf.data.Dataset.from_tensor_slices((files, labels_of(len(files))))
            .repeat()
            .shuffle(len(files))
        )
        ds = ds.map(
            lambda path, label: tf_train_sample(tf, tf.io.read_file(path), label),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    else:
        spec = {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
        }

        def parse(record: Any) -> Any:
            parsed = tf.io.parse_single_example(record, spec)
            return tf_train_sample(tf, parsed["image"], parsed["label"])

        shards = tf.data.Dataset.from_tensor_slices(tfrecord_shards(files)).repeat()
        records = shards.interleave(
            tf.data.TFRecordDataset, cycle_length=CYCLE, num_parallel_calls=tf.data.AUTOTUNE
        )
        ds = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def tfdata_native(workload: str, files: list[str], batch_size: int) -> Iterable[Any]:
    """``tfdata_native``: :func:`tf_dataset`'s batches as torch tensors."""
    return (tuple(_to_torch(t) for t in batch) for batch in tf_dataset(workload, files, batch_size))


def _to_torch(tensor: Any) -> torch.Tensor:
    """A TensorFlow tensor as a torch tensor viewing its memory (read-only, as TensorFlow's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(tensor))


# -- FFCV ------------------------------------------------------------------------------------------
def ffcv(files: list[str], batch_size: int) -> Iterable[Any]:
    """``ffcv``: FFCV's random resized crop decoder, flip, uint8 CHW (no normalization)."""
    from bench import ffcv_peer

    ffcv_peer._import(os.cpu_count() or 1)
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    image = [
        RandomResizedCropRGBImageDecoder((SIZE, SIZE), scale=SCALE, ratio=RATIO),
        RandomHorizontalFlip(),
        ToTensor(),
        ToTorchImage(channels_last=False),
    ]
    indices = np.resize(np.arange(len(files), dtype=np.uint64), EPOCH)
    return Loader(
        ffcv_peer.beton(files),
        batch_size=batch_size,
        num_workers=os.cpu_count() or 1,
        os_cache=True,
        order=OrderOption.RANDOM,
        indices=indices,
        drop_last=True,
        pipelines={"image": image, "label": [IntDecoder(), ToTensor(), Squeeze(1)]},
    )


# -- the rows ------------------------------------------------------------------------------------
Builder = Callable[[list[str], int], Iterable[Any]]


def builders(workload: str) -> dict[str, Builder]:
    """The configurations measured on ``workload``, by row name."""
    rows: dict[str, Builder] = {
        "torchpipe_tpimage": lambda f, b: tpimage(workload, f, b),
        "torchpipe_tpimage_unfused": lambda f, b: tpimage(workload, f, b, fused=False),
    }
    if workload == "jpeg":
        rows["tp_dataloader_auto"] = tp_dataloader
        for n in TORCH_WORKERS:
            rows[f"torch_dataloader_torchvision_w{n}"] = lambda f, b, n=n: torch_dataloader(f, b, n)
    rows["tfdata_native"] = lambda f, b: tfdata_native(workload, f, b)
    if workload == "jpeg":
        rows["ffcv"] = ffcv
    return rows


def missing(row: str) -> str | None:
    """Why ``row`` cannot run here (its peer is not installed), or None."""
    module = {"tfdata_native": "tensorflow", "ffcv": "ffcv"}.get(row)
    if module is None:
        return None
    import importlib.util

    return None if importlib.util.find_spec(module) else f"{module} is not installed"


def cpu_seconds() -> float:
    """CPU time of this process and its children (worker processes, a zygote)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass  # ended in between
    return total


def measure(it: Iterator[Any], count: int) -> dict[str, float]:
    """Images a second and CPU milliseconds an image over the next ``count`` batches of ``it``."""
    images, cpu0, start = 0, cpu_seconds(), time.perf_counter()
    for _ in range(count):
        images += len(next(it)[0])
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    return {"img_s": images / wall, "cpu_ms": cpu / images * 1e3}


def check_batch(batch: Any, batch_size: int, dtype: torch.dtype = torch.float32) -> None:
    """Raise unless ``batch`` is (images [batch_size, 3, 224, 224] of ``dtype``, labels)."""
    images, labels = batch[0], batch[1]
    if (
        tuple(images.shape) != (batch_size, 3, SIZE, SIZE)
        or images.dtype != dtype
        or len(labels) != batch_size
    ):
        raise AssertionError(
            f"unexpected batch: {images.dtype} {tuple(images.shape)}, {len(labels)} labels"
        )


def run_one(
    row: str, workload: str, files: int, batch_size: int, warmup: int, count: int
) -> dict[str, Any]:
    """One configuration measured in this process (a fresh one: ``--one``)."""
    why = missing(row)
    if why is not None:
        return {"not_run": why}
    it = iter(builders(workload)[row](data.photo_jpeg_files(files), batch_size))
    check_batch(next(it), batch_size, torch.uint8 if row == "ffcv" else torch.float32)
    for _ in range(warmup - 1):
        next(it)
    result: dict[str, Any] = measure(it, count)
    return result


def run_fresh(row: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run_one` in a fresh interpreter; its JSON line, or the error it ended with."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        row,
        "--workload",
        workload,
        "--files",
        str(args.files),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--batches",
        str(args.batches),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def rounds(workload: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every row of ``workload`` in ``args.rounds`` alternating rounds; medians by row."""
    rows = [r for r in builders(workload) if not args.rows or r in args.rows]
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
    for k in range(args.rounds):
        for row in rows if k % 2 == 0 else rows[::-1]:
            runs[row].append(run_fresh(row, workload, args))
    return {row: summary(results) for row, results in runs.items()}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r for r in results if "img_s" in r]
    if not measured:
        return results[-1]
    rates = [r["img_s"] for r in measured]
    return {
        "img_s": statistics.median(rates),
        "cpu_ms": statistics.median(r["cpu_ms"] for r in measured),
        "runs": len(measured),
        "spread": max(rates) / min(rates) - 1,
    }


def table(workload: str, rows: dict[str, dict[str, Any]]) -> str:
    """A markdown table: each row's images a second, CPU an image, and ratios to the peers."""
    tf = rows.get("tfdata_native", {}).get("img_s")
    torch_best = max(
        (r["img_s"] for n, r in rows.items() if n.startswith("torch_") and "img_s" in r),
        default=None,
    )
    lines = [
        f"| {workload} | img/s | CPU ms/img | vs tfdata_native | vs torch best |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "img_s" not in r:
            lines.append(f"| {name} | not run: {r.get('not_run') or r.get('error')} | | | |")
            continue
        ratio = [f"{r['img_s'] / ref:.2f}x" if ref else "-" for ref in (tf, torch_best)]
        spread = f" (spread {r['spread']:.0%})" if "spread" in r else ""
        lines.append(
            f"| {name} | {r['img_s']:.0f}{spread} | {r['cpu_ms']:.2f} | {ratio[0]} | {ratio[1]} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer files and batches")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, help="photo JPEGs (default 2048; quick 512)")
    parser.add_argument("--batches", type=int, help="batches timed per run (default 40; quick 15)")
    parser.add_argument(
        "--warmup", type=int, default=4, help="batches before the timed ones (at least 1)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workload", choices=WORKLOADS, action="append", help="default: both")
    parser.add_argument("--rows", nargs="*", help="only these rows")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a row, measured in this process
    parser.add_argument(
        "--decode", action="store_true", help="measure the decode alone (bench/partial_decode.py)"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.files = args.files or (512 if args.quick else 2048)
    args.batches = args.batches or (15 if args.quick else 40)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        workload = (args.workload or ["jpeg"])[0]
        print(
            json.dumps(
                run_one(args.one, workload, args.files, args.batch_size, args.warmup, args.batches)
            )
        )
        return
    if args.decode:
        from bench import partial_decode

        partial_decode.main(["--files", str(min(args.files, 512))])
        return
    results = {}
    for workload in args.workload or WORKLOADS:
        results[workload] = rounds(workload, args)
        print(table(workload, results[workload]) + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

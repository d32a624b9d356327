"""FFCV's adapter: the ``jpeg`` workload's files in a .beton, read by FFCV's own loader and ops.

FFCV (``ffcv.loader.Loader``) runs no Python item: like ``tfdata_native`` it runs its own ops,
compiled by numba and run without the GIL on ``num_workers`` threads, over its own file format.
``ffcv_best`` is the best of its grid, ``num_workers`` at each thread count of the workload's
grid (the cores and twice the cores; numba's threading layer, TBB where it is installed, may run
no more threads than cores), the .beton memory-mapped (``os_cache=True``: the page cache holds
it), ``OrderOption.RANDOM``, two batches read ahead (``BATCHES_AHEAD``). Only ``jpeg`` has a
configuration. Where the work differs from the workload's item (decode with Pillow, random
224 crop, random flip, a CHW uint8 tensor and the label ``i % 1000``):

* The data: a .beton written once from the workload's files, before any measurement (cached
  next to the bench data, keyed by the file list; ``beton``). FFCV's ``RGBImageField`` stores
  JPEGs it encodes itself from the decoded pixels (see ``_write``); file ``k``'s label is
  ``k % 1000``.
* Decode: libjpeg-turbo with its fast, less exact inverse DCT (``TJFLAG_FASTDCT``), where Pillow
  uses the exact one.
* Crop: FFCV has no random crop without a resize (``RandomResizedCropRGBImageDecoder`` picks a
  random area of 8-100% at a random aspect ratio and resizes it to 224, more work than the
  item's). ``_random_crop_decoder`` is FFCV's crop-and-resize decoder with the item's window: a
  random 224 x 224 one, which OpenCV's resize copies as it is (the same size in and out).
* Flip, layout, labels: ``RandomHorizontalFlip``, ``ToTensor``, ``ToTorchImage(channels_last=
  False)`` (contiguous CHW as the item's; FFCV's default hands a channels-last view without
  that copy), labels through ``IntDecoder``, ``ToTensor``, ``Squeeze``: the batch is
  ``(uint8 [64, 3, 224, 224], int64 [64])`` as every other configuration's.
* Batches: views of FFCV's ring of ``BATCHES_AHEAD + 2`` preallocated batches, overwritten a few
  batches later (FFCV's contract: a training loop is done with a batch before it draws the
  next few), where the other loaders hand fresh tensors.
* Epochs: one epoch is the files repeated to ``EPOCH_ITEMS`` items, longer than any measured
  window, as the item's stream of indices is; an epoch's start (its permutation, buffers and
  thread) is paid once per epoch, as in training.

The first batch includes numba compiling the pipeline (seconds, on every new ``Loader``).
Importing FFCV, making a ``Loader`` and starting its epoch set torch's intra-op thread count
(process-wide) to FFCV's: it is set back each time, so the configurations measured afterwards
run as they would have. FFCV is imported when the configurations are made, to write the .beton
outside any timed window.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import data
from bench import workloads as wl
from bench.peer_items import STOP_TIMEOUT_S, PeerConfig, PeerIterator, grid_of
from torchpipe.runtime.cpu import usable_cpu_count

BATCHES_AHEAD = 2
"""Batches FFCV prepares ahead (its ``batches_ahead``; default 3): DataLoader's prefetch_factor,
as the other peers read ahead."""
EPOCH_ITEMS = 1_281_167
"""Items in one FFCV epoch (ImageNet's training set): the workload's files repeated."""
BETON = "images.beton"


def configs(work: wl.Workload, quick: bool) -> list[PeerConfig]:
    """FFCV's grid on ``jpeg`` (none on the other workloads): its loader at each thread count."""
    if work.name != "jpeg":
        return []
    threads = sorted({n for n, _ in grid_of(work, quick)})
    _import(max(threads))
    path = beton(work.files)
    return [
        PeerConfig(
            {"num_workers": n, "os_cache": True, "order": "RANDOM"},
            partial(_ffcv, path, len(work.files), work.batch_size, n),
        )
        for n in threads
    ]


@contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """Set torch's intra-op thread count back after the block (FFCV's ``Compiler.set_num_threads``
    sets it, and numba's, to its own)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _import(most_threads: int) -> None:
    """Import FFCV, with numba allowed ``most_threads`` threads (it reads ``NUMBA_NUM_THREADS``
    once, when imported; by default it allows one a CPU, and ``Loader`` fails asking for more)."""
    if "numba" not in sys.modules:
        os.environ.setdefault("NUMBA_NUM_THREADS", str(max(most_threads, os.cpu_count() or 1)))
    with _torch_threads_kept():
        importlib.import_module("ffcv.loader")


def beton(files: list[str]) -> str:
    """The .beton of ``files`` (fields ``image`` and ``label``), written once and reused."""
    key = hashlib.sha256("\n".join(files).encode()).hexdigest()[:16]
    root = data._materialize(f"ffcv-v1-{key}", lambda tmp: _write(tmp / BETON, files))
    return str(root / BETON)


def _write(path: Path, files: list[str]) -> None:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    # RGBImageField re-encodes the pixels it is given (OpenCV's libjpeg-turbo); it cannot keep a
    # file's own bytes. At the files' quality (data.JPEG_QUALITY, 90) and chroma subsampling
    # (4:2:0, both encoders' default) the re-encoded JPEGs have the files' mean size (26.5 KB
    # either way on the 1,024 quick files, within 0.3%), so each costs a decode of the same
    # size. write_mode="raw" would store pixels: no decode at all.
    fields = {
        "image": RGBImageField(write_mode="jpg", jpeg_quality=data.JPEG_QUALITY),
        "label": IntField(),
    }
    writer = DatasetWriter(str(path), fields, num_workers=usable_cpu_count())
    writer.from_indexed_dataset(wl.Mapped(wl.DecodeJpeg(files), len(files)))


def _random_window(height: int, width: int, scale: Any, ratio: Any) -> tuple[int, int, int, int]:
    """A random ``CROP`` x ``CROP`` window's top, left, height and width (compiled by numba)."""
    return (
        np.random.randint(0, height - wl.CROP + 1),
        np.random.randint(0, width - wl.CROP + 1),
        wl.CROP,
        wl.CROP,
    )


def _random_crop_decoder() -> Any:
    """FFCV's crop-and-resize JPEG decoder with the workload's random 224 crop as its window."""
    from ffcv.fields.rgb_image import ResizedCropRGBImageDecoder

    class RandomCrop(ResizedCropRGBImageDecoder):
        def __init__(self) -> None:
            super().__init__((wl.CROP, wl.CROP))
            self.scale = self.ratio = None  # the window's size is fixed

        @property
        def get_crop_generator(self) -> Any:
            return _random_window

    return RandomCrop()


def _ffcv(path: str, files: int, batch_size: int, threads: int) -> PeerIterator:
    from ffcv.fields.decoders import IntDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    image = [
        _random_crop_decoder(),
        RandomHorizontalFlip(),
        ToTensor(),
        ToTorchImage(channels_last=False),
    ]
    pipelines = {"image": image, "label": [IntDecoder(), ToTensor(), Squeeze(1)]}
    indices = np.resize(np.arange(files, dtype=np.uint64), EPOCH_ITEMS)
    torch_threads = torch.get_num_threads()
    with _torch_threads_kept():
        loader = Loader(
            path,
            batch_size=batch_size,
            num_workers=threads,
            os_cache=True,
            order=OrderOption.RANDOM,
            indices=indices,
            pipelines=pipelines,
            batches_ahead=BATCHES_AHEAD,
        )
        epoch = iter(loader)  # starts a thread that runs the epoch

    def stop() -> None:
        epoch.close()  # its thread ends when its queue next refuses a batch
        epoch.join(STOP_TIMEOUT_S)
        torch.set_num_threads(torch_threads)  # the thread set it again as it started

    return PeerIterator(epoch, stop)

"""ImageNet-style training input with ``tp.image``: an ImageFolder directory -> decode, random
resized crop, flip, normalize on threads -> a training loop.

Run: python examples/imagenet_style.py [--root DIR] [--steps N] [--loader]

``--root`` is a directory of class folders of images (``root/<class>/<file>``), as torchvision's
``ImageFolder`` reads; without it a small synthetic one is made in a temporary directory, with the
kinds of JPEG real data sets hold (photos of several sizes, some grayscale, CMYK or progressive).
``--loader`` feeds the same work through ``tp.DataLoader(num_workers="auto")`` over a map-style
dataset written with ``tp.image`` (the one-line change from torchvision's transforms) instead of
the pipeline DSL. Either way the report at the end says where the work ran (threads, measured),
how fast, and how many images the fast decoder handed to Pillow.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from collections.abc import Iterable

import numpy as np
import torch
from PIL import Image

import torchpipe as tp

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 224
EXTENSIONS = (".jpg", ".jpeg", ".png")


def samples(root: str) -> list[tuple[str, int]]:
    """(path, label) for every image under ``root/<class>/``, classes numbered in sorted order."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    return [
        (os.path.join(root, name, f), label)
        for label, name in enumerate(classes)
        for f in sorted(os.listdir(os.path.join(root, name)))
        if f.lower().endswith(EXTENSIONS)
    ]


def make_folder(root: str, classes: int = 4, per_class: int = 48) -> None:
    """A synthetic ImageFolder: smooth photo-like JPEGs of 300-800 px, every 8th grayscale, CMYK or
    progressive."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(300, 801, size=2))
            coarse = rng.integers(0, 256, size=(5, 5, 3), dtype=np.uint8)
            image = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
            kind = i % 8
            params = {"quality": 90, "progressive": kind == 3}
            image = (
                image.convert("L") if kind == 1 else image.convert("CMYK") if kind == 2 else image
            )
            image.save(os.path.join(root, f"class{c}", f"{i:04d}.jpg"), **params)


def train_sample(path: str, label: int) -> tuple[torch.Tensor, int]:
    """torchvision's RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize, in tp.image."""
    image = tp.image.decode_and_random_resized_crop(path, SIZE)
    return tp.image.to_tensor(tp.image.random_flip_left_right(image), MEAN, STD), label


class ImageFolder(torch.utils.data.Dataset):
    """A torchvision-style map-style dataset, written with tp.image."""

    def __init__(self, root: str) -> None:
        self.samples = samples(root)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return train_sample(*self.samples[i])


def pipeline(root: str, batch_size: int) -> tp.Dataset:
    return (
        tp.from_iterable(samples(root))
        .shuffle(10_000)
        .map(train_sample, num_parallel_calls=tp.AUTOTUNE)
        .batch(batch_size, drop_remainder=True)
        .prefetch(tp.AUTOTUNE)
        .repeat()
        .with_options(tp.Options(seed=0))
    )


def model(classes: int) -> torch.nn.Module:
    """Small on purpose: the input pipeline is what this example is about."""
    nn = torch.nn
    return nn.Sequential(
        nn.AvgPool2d(8),
        nn.Conv2d(3, 16, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def train(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int, classes: int
) -> tuple[int, float]:
    net = model(classes)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    images, start = 0, time.perf_counter()
    for step, (x, y) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        images += len(y)
        if step + 1 == steps:
            break
    return images, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", help="an ImageFolder directory; default: a synthetic one")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--loader", action="store_true", help="tp.DataLoader(num_workers='auto') over a Dataset"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if root is None:
            root = tmp
            make_folder(root)
        classes = len({label for _, label in samples(root)})
        if args.loader:
            loader = tp.DataLoader(
                ImageFolder(root),
                batch_size=args.batch_size,
                shuffle=True,
                drop_last=True,
                num_workers="auto",
                persistent_workers=True,
            )
            batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
            images, seconds = train(batches, args.steps, classes)
            stats = loader.stats()
        else:
            it = iter(pipeline(root, args.batch_size))
            images, seconds = train(it, args.steps, classes)
            stats = it.stats()
            it.close()
    work = next(s for s in stats if s["stage"].startswith(("map(", "DataLoader")))
    where = (
        f"{work['executor']} x{work['workers']}"
        if work.get("workers")
        else work.get("executor", "inline")
    )
    print(f"{images} images in {seconds:.2f} s: {images / seconds:.0f} img/s, work on {where}")
    print(f"decoded {stats.images['decoded']} images, {stats.images['fallback']} of them by Pillow")


if __name__ == "__main__":
    main()

"""Geometry and conversion on decoded images: crop, flip, resize, to a normalized float tensor.

Images are uint8 tensors of shape (height, width, channels), as the decoders give them. Every op
here is one or two torch or numpy kernels, which run without the GIL; the random ones draw from
:func:`generator`, so a pipeline's output is the same for any executor and worker count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch.nn import functional

from torchpipe.randomness import rng as element_rng
from torchpipe.runtime.recycle import batch_row

Size = int | Sequence[int]
"""An output size: ``(height, width)``, or one int for a square."""


def generator(rng: np.random.Generator | None) -> np.random.Generator:
    """The generator a random op draws from: ``rng`` if given; else ``tp.rng()`` inside a function
    a torchpipe pipeline or ``tp.DataLoader`` runs (the same numbers on any worker, thread or
    resume); else one seeded from torch's global generator (as torchvision's transforms draw, so
    ``torch.manual_seed`` and torch's own DataLoader workers seed it)."""
    if rng is not None:
        if not isinstance(rng, np.random.Generator):
            raise TypeError(
                f"rng must be a numpy Generator (e.g. tp.rng()) or None, got {type(rng).__name__}"
            )
        return rng
    try:
        return element_rng()
    except RuntimeError:  # not inside a torchpipe call
        return np.random.default_rng(int(torch.randint(0, 2**62, (), dtype=torch.int64)))


def pair(size: Size, what: str = "size") -> tuple[int, int]:
    """``size`` as (height, width), checked."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        h = w = int(size)
    elif (
        isinstance(size, Sequence)
        and len(size) == 2
        and all(isinstance(v, (int, np.integer)) for v in size)
    ):
        h, w = (int(v) for v in size)
    else:
        raise TypeError(f"{what} must be an int or (height, width), got {size!r}")
    if h <= 0 or w <= 0:
        raise ValueError(f"{what} must be positive, got {size!r}")
    return h, w


def check_image(image: torch.Tensor, op: str) -> None:
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise TypeError(
            f"{op} takes an image tensor of shape (height, width, channels), got {shape}"
        )


def crop(image: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    """The window at (top, left) of ``height`` x ``width``: a view (no copy).

    Raises:
        ValueError: the window is not inside the image.
    """
    check_image(image, "crop")
    full_h, full_w = image.shape[:2]
    if (
        height <= 0
        or width <= 0
        or top < 0
        or left < 0
        or top + height > full_h
        or left + width > full_w
    ):
        raise ValueError(
            f"the window (top={top}, left={left}, height={height}, width={width}) is not inside "
            f"the {full_h}x{full_w} image"
        )
    return image[top : top + height, left : left + width]


def center_crop(image: torch.Tensor, size: Size) -> torch.Tensor:
    """The central ``size`` window (a view), as torchvision's ``CenterCrop`` places it."""
    check_image(image, "center_crop")
    h, w = pair(size)
    return crop(image, round((image.shape[0] - h) / 2.0), round((image.shape[1] - w) / 2.0), h, w)


def random_crop(
    image: torch.Tensor, size: Size, rng: np.random.Generator | None = None
) -> torch.Tensor:
    """A ``size`` window at a uniformly drawn place (a view), as ``tf.image.random_crop``.

    Raises:
        ValueError: the image is smaller than ``size``.
    """
    check_image(image, "random_crop")
    h, w = pair(size)
    full_h, full_w = image.shape[:2]
    if h > full_h or w > full_w:
        raise ValueError(
            f"random_crop of {h}x{w} from a {full_h}x{full_w} image: the image is smaller"
        )
    gen = generator(rng)
    top, left = int(gen.integers(full_h - h + 1)), int(gen.integers(full_w - w + 1))
    return image[top : top + h, left : left + w]


def flip_left_right(image: torch.Tensor) -> torch.Tensor:
    """The image mirrored left to right (a copy)."""
    check_image(image, "flip_left_right")
    return image.flip(1)


def random_flip_left_right(
    image: torch.Tensor, p: float = 0.5, rng: np.random.Generator | None = None
) -> torch.Tensor:
    """The image mirrored with probability ``p``, else itself."""
    check_image(image, "random_flip_left_right")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    return image.flip(1) if generator(rng).random() < p else image


def resize(image: torch.Tensor, size: Size, antialias: bool = True) -> torch.Tensor:
    """Bilinear resize of an HWC image (uint8 or float) to ``size``; one int resizes the shorter
    side to it, keeping the aspect ratio, as torchvision's ``Resize``.

    With ``antialias`` (the default, as torchvision and Pillow) a shrink averages over the source
    pixels; uint8 results are within 1 of Pillow's ``BILINEAR``. The result views channels-first
    memory (torch's kernel writes it so): ``to_tensor`` copies it without a transpose.
    """
    check_image(image, "resize")
    full_h, full_w = image.shape[:2]
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        short = pair(size)[0]
        if full_h <= full_w:
            h, w = short, max(1, int(short * full_w / full_h))
        else:
            h, w = max(1, int(short * full_h / full_w)), short
    else:
        h, w = pair(size)
    if (h, w) == (full_h, full_w):
        return image
    batch = image.permute(2, 0, 1).unsqueeze(0)  # NCHW over HWC memory: channels-last, no copy
    if image.dtype == torch.uint8:
        out = functional.interpolate(
            batch, size=(h, w), mode="bilinear", antialias=antialias, align_corners=False
        )
    else:
        out = functional.interpolate(
            batch.float(), size=(h, w), mode="bilinear", antialias=antialias, align_corners=False
        )
        out = out.to(image.dtype)
    return out[0].permute(1, 2, 0)


def to_tensor(
    image: torch.Tensor,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """An HWC image as a CHW tensor of ``dtype``: a float one in [0, 1] (uint8 values / 255),
    normalized by ``mean`` and ``std`` (per channel, on the [0, 1] scale, as torchvision's
    ``Normalize``) when they are given; ``dtype=torch.uint8`` keeps the values (only the layout
    changes), as FFCV's ``ToTorchImage``.

    Transpose and conversion are one copy into the output, normalization one pass over it. In a
    ``map`` whose results go straight to a ``batch`` (no shuffle or cache between), the output is
    the image's row of the batch being built (:func:`~torchpipe.runtime.recycle.batch_row`), so
    the batch copies nothing more: a function that also keeps it sees the batch's memory.

    Raises:
        ValueError: ``mean`` and ``std`` with an integer ``dtype``, or one without the other.
    """
    check_image(image, "to_tensor")
    if not dtype.is_floating_point and (mean is not None or std is not None):
        raise ValueError(f"mean and std normalize to floats: ask for a float dtype, not {dtype}")
    height, width, channels = image.shape
    out = output((channels, height, width), dtype)
    if image.device.type == "cpu" and dtype in _NUMPY_DTYPES and image.dtype in _NUMPY_DTYPES:
        # numpy's strided copy is faster
        np.copyto(out.numpy(), image.numpy().transpose(2, 0, 1), casting="unsafe")
    else:
        out.copy_(image.permute(2, 0, 1))
    if not dtype.is_floating_point:
        return out
    peak = 255.0 if image.dtype == torch.uint8 else 1.0
    if mean is None and std is None and peak == 1.0:
        return out
    scale, shift = _affine(channels, _values(mean), _values(std), peak, dtype)
    return out.mul_(scale).add_(shift)  # two in-place passes beat one broadcast addcmul (~6x)


_NUMPY_DTYPES = (torch.uint8, torch.float16, torch.float32, torch.float64)


def output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor for an op's result: the row of the batch being built on this thread where
    it has one of that shape and dtype (:func:`~torchpipe.runtime.recycle.batch_row`), else
    ``torch.empty``."""
    row = batch_row(shape, dtype)
    return row if row is not None else torch.empty(shape, dtype=dtype)


def normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``(image - mean) / std`` per channel: an HWC uint8 image goes to a CHW float tensor in one
    pass (as :func:`to_tensor` with ``mean`` and ``std``); a CHW float tensor in [0, 1] (as
    torchvision's ``ToTensor`` gives) comes back normalized, a new tensor."""
    if image.dtype == torch.uint8:
        return to_tensor(image, mean, std)
    if not isinstance(image, torch.Tensor) or image.dim() != 3 or not image.is_floating_point():
        raise TypeError("normalize takes an HWC uint8 image or a CHW float tensor")
    scale, shift = _affine(image.shape[0], _values(mean), _values(std), 1.0, image.dtype)
    return image.mul(scale).add_(shift)


def _values(values: Sequence[float] | float | None) -> tuple[float, ...] | None:
    """``mean`` or ``std`` as a tuple (the cache's key); a single number stands for every channel."""
    if values is None:
        return None
    if isinstance(values, (int, float)):
        return (float(values),)
    if isinstance(values, torch.Tensor):
        return tuple(float(v) for v in values.flatten().tolist())
    return tuple(float(v) for v in values)


@functools.lru_cache(maxsize=64)  # a pipeline normalizes every image with the same few constants
def _affine(
    channels: int,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
    peak: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) with ``x * scale + shift == (x / peak - mean) / std``, shaped (C, 1, 1)."""
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    m = (
        torch.zeros(channels, dtype=torch.float64)
        if mean is None
        else _per_channel(mean, channels, "mean")
    )
    s = (
        torch.ones(channels, dtype=torch.float64)
        if std is None
        else _per_channel(std, channels, "std")
    )
    if bool((s == 0).any()):
        raise ValueError(f"std must not be 0, got {list(std or [])}")
    return (1.0 / (peak * s)).to(dtype).view(-1, 1, 1), (-m / s).to(dtype).view(-1, 1, 1)


def _per_channel(values: tuple[float, ...], channels: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64).flatten()
    if t.numel() == 1:
        return t.expand(channels).clone()
    if t.numel() != channels:
        raise ValueError(f"{name} has {t.numel()} values for an image of {channels} channels")
    return t

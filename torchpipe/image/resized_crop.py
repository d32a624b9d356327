"""Random resized crop (ImageNet training's augmentation), fused with the decode.

The window is drawn as torchvision's ``RandomResizedCrop`` draws it (an area share from ``scale``,
an aspect ratio log-uniform in ``ratio``, ten tries, then the central crop), from the header's
size alone. The JPEG is then decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still gives
the window at least the output size, so a window twice the output or more costs a fraction of a
full decode; the window is cut from that and resized.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from torchpipe.image import formats
from torchpipe.image.transforms import Size, check_image, generator, pair, resize

_TRIES = 10  # torchvision's


def random_resized_crop_window(
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    rng: np.random.Generator | None = None,
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a window of a ``height`` x ``width`` image, drawn as
    torchvision's ``RandomResizedCrop.get_params`` draws it (the numbers come from ``rng``).

    Raises:
        ValueError: ``scale`` or ``ratio`` is not an increasing pair of positive numbers.
    """
    _check_range(scale, "scale")
    _check_range(ratio, "ratio")
    gen = generator(rng)
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(_TRIES):
        target = area * gen.uniform(scale[0], scale[1])
        aspect = math.exp(gen.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(gen.integers(height - h + 1)), int(gen.integers(width - w + 1)), h, w
    in_ratio = width / height  # the central crop at the nearest allowed ratio
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def _check_range(pair_: tuple[float, float], name: str) -> None:
    if len(pair_) != 2 or not 0 < pair_[0] <= pair_[1]:
        raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {pair_!r}")


def random_resized_crop(
    image: torch.Tensor,
    size: Size,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    rng: np.random.Generator | None = None,
) -> torch.Tensor:
    """A window drawn as :func:`random_resized_crop_window` draws it, resized to ``size``
    (bilinear, antialiased); the image is HWC and decoded already."""
    check_image(image, "random_resized_crop")
    top, left, h, w = random_resized_crop_window(image.shape[0], image.shape[1], scale, ratio, rng)
    return resize(image[top : top + h, left : left + w], pair(size))


def dct_scale(window: tuple[int, int], size: tuple[int, int]) -> int:
    """The largest of :data:`~torchpipe.image.formats.SCALES` by which ``window`` can shrink and
    stay at least ``size``: a JPEG is decoded at 1/that."""
    return max(
        (k for k in formats.SCALES if window[0] >= size[0] * k and window[1] >= size[1] * k),
        default=1,
    )


def decode_and_random_resized_crop(
    data: formats.ImageData,
    size: Size,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    rng: np.random.Generator | None = None,
    channels: int = 3,
    apply_exif_orientation: bool = False,
    fast_dct: bool = False,
) -> torch.Tensor:
    """Decode a JPEG (or, through Pillow, any image), crop a random window and resize it to
    ``size``: torchvision's ``RandomResizedCrop`` on the decoded image, at a fraction of the
    decoding cost where the window is twice the output or more (the DCT's scaling).

    Args:
        data: the encoded bytes or a file's path.
        size: the output (height, width), or one int for a square.
        scale, ratio: the window's area share and aspect ratio ranges (torchvision's defaults).
        rng: the numpy Generator to draw from; by default ``tp.rng()`` inside a pipeline.
        channels: 3 (RGB) or 1 (grayscale).
        apply_exif_orientation: turn the image upright first (the window is drawn on it upright).
        fast_dct: libjpeg-turbo's fast IDCT, as :func:`~torchpipe.image.decode.decode_jpeg`.

    Returns:
        A uint8 tensor of shape (height, width, channels), viewing resize's channels-first
        memory (``to_tensor`` then copies it straight, without a transpose).

    Raises:
        DecodeError: the image is malformed or truncated.
    """
    formats.check_channels(channels)
    return decode_resized_window(
        formats.EncodedImage(data),
        pair(size),
        scale,
        ratio,
        generator(rng),
        channels,
        apply_exif_orientation,
        fast_dct,
    )


def decode_resized_window(
    image: formats.EncodedImage,
    size: tuple[int, int],
    scale: tuple[float, float],
    ratio: tuple[float, float],
    gen: np.random.Generator,
    channels: int,
    apply_exif_orientation: bool,
    fast_dct: bool,
) -> torch.Tensor:
    """:func:`decode_and_random_resized_crop` on checked arguments, drawing from ``gen``."""
    out_h, out_w = size
    if formats.image_format(image) != "jpeg":
        return random_resized_crop(formats.decode_other(image, channels), size, scale, ratio, gen)
    full_h, full_w = formats.jpeg_size(image)
    orientation = formats.exif_orientation(image.data) if apply_exif_orientation else 1
    if orientation >= 5:
        full_h, full_w = full_w, full_h
    top, left, h, w = random_resized_crop_window(full_h, full_w, scale, ratio, gen)
    k = dct_scale((h, w), size)
    decoded = formats.decode_jpeg_array(image, channels, k, fast_dct=fast_dct)
    pixels = formats.orient(formats.as_tensor(decoded), orientation)
    # the window in the scaled image's pixels (its sides are the full ones / k, rounded up)
    if k > 1:
        sy, sx = pixels.shape[0] / full_h, pixels.shape[1] / full_w
        top, left = int(top * sy), int(left * sx)
        h = max(1, min(round(h * sy), pixels.shape[0] - top))
        w = max(1, min(round(w * sx), pixels.shape[1] - left))
    return resize(pixels[top : top + h, left : left + w], (out_h, out_w))

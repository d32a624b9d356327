"""The training transform of image classification in one op: decode, RandomResizedCrop, random
flip, to a normalized float CHW tensor, written straight into the batch.

Unfused, the same work makes three tensors an image besides the decode's (the flipped copy, the
float CHW copy, and the row of the batch it is copied to). Here the resize's uint8 output is
converted, flipped and normalized in one pass into the tensor returned, and that tensor is the
image's row of the batch where a batch fused with the map is being built on this thread
(:func:`~torchpipe.runtime.recycle.batch_row`): nothing is copied after the op returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchpipe.image import formats
from torchpipe.image.resized_crop import decode_resized_window
from torchpipe.image.transforms import Size, _affine, _values, generator, output, pair


def train_transform(
    data: formats.ImageData,
    size: Size,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: float = 0.5,
    rng: np.random.Generator | None = None,
    channels: int = 3,
    dtype: torch.dtype = torch.float32,
    apply_exif_orientation: bool = False,
    fast_dct: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode an image, crop a random window resized to ``size``, mirror it with probability
    ``flip`` and convert it to a CHW tensor, normalized by ``mean`` and ``std``: torchvision's
    ``RandomResizedCrop``, ``RandomHorizontalFlip``, ``ToTensor`` and ``Normalize`` in one op.

    With the same ``rng`` it gives exactly what
    ``to_tensor(random_flip_left_right(decode_and_random_resized_crop(data, size, scale, ratio,
    rng), flip, rng), mean, std, dtype)`` gives, at less CPU: the resized crop is flipped,
    converted and normalized in one pass, into the batch being built where there is one.

    Args:
        data: the encoded bytes or a file's path (JPEG by the fast path; other formats by Pillow).
        size: the output (height, width), or one int for a square.
        mean, std: per-channel normalization on the [0, 1] scale (both or neither).
        scale, ratio: the window's area share and aspect ratio ranges (torchvision's defaults).
        flip: the probability of mirroring left to right.
        rng: the numpy Generator to draw from; by default ``tp.rng()`` inside a pipeline.
        channels: 3 (RGB) or 1 (grayscale).
        dtype: the output's; ``torch.uint8`` keeps the values (no ``mean``/``std``).
        apply_exif_orientation, fast_dct: as :func:`~torchpipe.image.decode_and_random_resized_crop`.
        out: a contiguous (channels, height, width) tensor of ``dtype`` to write into.

    Returns:
        A (channels, height, width) tensor of ``dtype``: ``out``, or the image's row of the batch.

    Raises:
        DecodeError: the image is malformed or truncated.
        ValueError: ``flip`` outside [0, 1], ``mean`` and ``std`` with an integer ``dtype``, a
            bad ``scale``/``ratio``, or an ``out`` of the wrong shape or dtype.
    """
    formats.check_channels(channels)
    out_h, out_w = pair(size)
    if not 0.0 <= flip <= 1.0:
        raise ValueError(f"flip must be a probability in [0, 1], got {flip!r}")
    affine = _normalization(channels, mean, std, dtype)
    gen = generator(rng)
    resized = decode_resized_window(
        formats.EncodedImage(data),
        (out_h, out_w),
        scale,
        ratio,
        gen,
        channels,
        apply_exif_orientation,
        fast_dct,
    )
    chw = resized.permute(2, 0, 1)  # resize writes channels-first memory: a contiguous view
    if gen.random() < flip:
        chw = chw.flip(2)
    dst = _destination(out, (channels, out_h, out_w), dtype)
    dst.copy_(chw)
    if affine is not None:
        dst.mul_(affine[0]).add_(affine[1])  # two in-place passes, as to_tensor (same values)
    return dst


def _normalization(
    channels: int, mean: Sequence[float] | None, std: Sequence[float] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, shift) that take uint8 values to ``dtype``'s normalized ones; None where the
    values are kept (an integer ``dtype``)."""
    if not dtype.is_floating_point:
        if mean is not None or std is not None:
            raise ValueError(
                f"mean and std normalize to floats: ask for a float dtype, not {dtype}"
            )
        return None
    return _affine(channels, _values(mean), _values(std), 255.0, dtype)


def _destination(
    out: torch.Tensor | None, shape: tuple[int, int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Where the image is written: ``out``, else its row of the batch being built, else new."""
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {dtype} tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}"
            )
        return out
    return output(shape, dtype)

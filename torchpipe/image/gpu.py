"""JPEG decoding on the GPU with nvJPEG, through torchvision's ``decode_jpeg``.

A list of images decodes as one batch (torchvision hands nvJPEG the whole list). Images nvJPEG
refuses (it does not read every JPEG a CPU decoder reads) are decoded on the CPU and copied over,
and counted with the CPU path's fallbacks in ``stats()``.
"""

from __future__ import annotations

from typing import Any

import torch

from torchpipe.image import formats
from torchpipe.runtime.counts import COUNTS


def _torchvision_decode() -> Any:
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        raise ImportError(
            "tp.image.decode_jpeg(..., device='cuda') decodes with torchvision's nvJPEG: install the "
            "torchvision build that matches your torch"
        ) from e
    return decode_jpeg, ImageReadMode


def decode_jpeg_on(
    device: torch.device, data: Any, channels: int, apply_exif_orientation: bool
) -> Any:
    """Decode one JPEG, or a list of them as a batch, on ``device`` (a CUDA device); HWC uint8."""
    if device.type != "cuda":
        raise ValueError(f"tp.image decodes on the CPU or a CUDA device, not {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"decode_jpeg(device={str(device)!r}): CUDA is not available here")
    many = isinstance(data, (list, tuple))
    images = [formats.EncodedImage(item) for item in (data if many else [data])]
    for image in images:
        if formats.image_format(image) != "jpeg":
            raise image.fail(f"not a JPEG: it starts with {image.head(8)!r}")
    decode_jpeg, mode = _torchvision_decode()
    encoded = [torch.frombuffer(bytearray(image.data), dtype=torch.uint8) for image in images]
    read_mode = mode.RGB if channels == 3 else mode.GRAY
    try:
        chw = decode_jpeg(encoded, mode=read_mode, device=device)
        out = [img.permute(1, 2, 0) for img in chw]
    except RuntimeError:  # nvJPEG refused one of them: each on its own, the refused ones on the CPU
        out = [
            _one(decode_jpeg, image, tensor, read_mode, channels, device)
            for image, tensor in zip(images, encoded)
        ]
    COUNTS.add("images_decoded", len(out))
    if apply_exif_orientation:
        out = [
            formats.orient(img, formats.exif_orientation(image.data))
            for img, image in zip(out, images)
        ]
    return out if many else out[0]


def _one(
    decode_jpeg: Any,
    image: formats.EncodedImage,
    tensor: torch.Tensor,
    read_mode: Any,
    channels: int,
    device: torch.device,
) -> torch.Tensor:
    try:
        return decode_jpeg(tensor, mode=read_mode, device=device).permute(1, 2, 0)
    except RuntimeError:
        COUNTS.add("images_fallback")
        return formats.as_tensor(formats.decode_jpeg_array(image, channels, count=False)).to(device)

"""The public decoders: JPEG, PNG, any image, and tf.data's decode-and-crop.

Images come out as uint8 tensors of shape (height, width, channels), RGB or grayscale, as tf.data's
``decode_jpeg`` gives them. EXIF orientation is not applied unless asked (``apply_exif_orientation``),
as in torchvision and Pillow. The decoding underneath is in :mod:`~torchpipe.image.formats`.
"""

from __future__ import annotations

from typing import Any

import torch

from torchpipe.image.formats import (
    EncodedImage,
    ImageData,
    as_tensor,
    check_channels,
    decode_jpeg_array,
    decode_other,
    exif_orientation,
    image_format,
    jpeg_size,
    orient,
)


def decode_jpeg(
    data: ImageData,
    channels: int = 3,
    apply_exif_orientation: bool = False,
    device: Any = None,
    fast_dct: bool = False,
) -> Any:
    """Decode a JPEG to a uint8 tensor of shape (height, width, channels).

    Args:
        data: the encoded bytes (``bytes``, a 1-D uint8 array or tensor) or a file's path; on a
            GPU, a list of them decodes as one batch.
        channels: 3 for RGB (grayscale and CMYK files are converted), 1 for grayscale.
        apply_exif_orientation: turn the image as its EXIF orientation says.
        device: ``"cuda"`` (or a CUDA device) decodes on the GPU with nvJPEG (needs torchvision);
            ``None`` or ``"cpu"`` on the CPU.
        fast_dct: libjpeg-turbo's fast integer IDCT, as ``tf.io.decode_jpeg`` uses by default
            (``dct_method=""``, ``INTEGER_FAST``): ~5% less CPU, pixels within a few levels of the
            accurate IDCT's (and TensorFlow's exactly). Off: Pillow's pixels.

    Returns:
        The image (a list of them for a list on the GPU).

    Raises:
        DecodeError: the data is not a JPEG, or is malformed or truncated (naming the file).
        TypeError, ValueError: for arguments of the wrong kind.
    """
    check_channels(channels)
    if device is not None and torch.device(device).type != "cpu":
        from torchpipe.image.gpu import decode_jpeg_on

        return decode_jpeg_on(torch.device(device), data, channels, apply_exif_orientation)
    image = EncodedImage(data)
    pixels = as_tensor(decode_jpeg_array(image, channels, fast_dct=fast_dct))
    return orient(pixels, exif_orientation(image.data)) if apply_exif_orientation else pixels


def decode_png(data: ImageData, channels: int = 3) -> torch.Tensor:
    """Decode a PNG to a uint8 tensor of shape (height, width, channels) with Pillow (16-bit
    images are reduced to 8 bits; alpha is dropped).

    Raises:
        DecodeError: the data is not a PNG, or is malformed or truncated.
    """
    check_channels(channels)
    image = EncodedImage(data)
    if image_format(image) != "png":
        raise image.fail(
            f"not a PNG: it starts with {image.head(8)!r} (tp.image.decode_image reads any format)"
        )
    return decode_other(image, channels)


def decode_image(
    data: ImageData, channels: int = 3, apply_exif_orientation: bool = False, fast_dct: bool = False
) -> torch.Tensor:
    """Decode any image Pillow reads (JPEG through the fast path, as :func:`decode_jpeg`; PNG,
    GIF's first frame, BMP, WebP, TIFF through Pillow) to a uint8 tensor of shape (height, width,
    channels).

    Raises:
        DecodeError: the data is no image Pillow knows, or is malformed or truncated.
    """
    check_channels(channels)
    image = EncodedImage(data)
    if image_format(image) == "jpeg":
        pixels = as_tensor(decode_jpeg_array(image, channels, fast_dct=fast_dct))
        return orient(pixels, exif_orientation(image.data)) if apply_exif_orientation else pixels
    return decode_other(image, channels)


def decode_and_crop_jpeg(
    data: ImageData,
    crop_window: tuple[int, int, int, int],
    channels: int = 3,
    apply_exif_orientation: bool = False,
    fast_dct: bool = False,
) -> torch.Tensor:
    """Decode a JPEG and keep ``crop_window`` = (top, left, height, width), as tf.data's
    ``decode_and_crop_jpeg``; the crop is a copy, so the whole decoded image is not kept alive.

    The window is checked against the header before anything is decoded. (The whole image is
    decoded: neither libjpeg-turbo binding exposes its partial decode.)

    Raises:
        ValueError: the window is empty or not inside the image.
        DecodeError: as :func:`decode_jpeg`.
    """
    check_channels(channels)
    image = EncodedImage(data)
    top, left, height, width = (int(v) for v in crop_window)
    full_h, full_w = jpeg_size(image)
    orientation = exif_orientation(image.data) if apply_exif_orientation else 1
    if orientation >= 5:
        full_h, full_w = full_w, full_h
    if (
        height <= 0
        or width <= 0
        or top < 0
        or left < 0
        or top + height > full_h
        or left + width > full_w
    ):
        where = f" of {image.path}" if image.path else ""
        raise ValueError(
            f"crop_window (top={top}, left={left}, height={height}, width={width}) is not inside "
            f"the {full_h}x{full_w} image{where}"
        )
    pixels = orient(as_tensor(decode_jpeg_array(image, channels, fast_dct=fast_dct)), orientation)
    return pixels[top : top + height, left : left + width].clone()

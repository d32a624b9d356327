"""The image formats under ``tp.image``'s decoders: JPEG through libjpeg-turbo (simplejpeg), other formats
and what it refuses through Pillow, headers, EXIF orientation.

Both release the GIL while they decode. The fast path is simplejpeg, a small wheel that bundles
libjpeg-turbo; where it is missing, or refuses a file (libjpeg-turbo's strict mode fails on files
with recoverable damage that Pillow reads), the image is decoded by Pillow, which uses
libjpeg-turbo too: the pixels are the same, within 1 for CMYK files. Every decode, and every one
Pillow had to do, is counted (:mod:`~torchpipe.runtime.counts`).

A JPEG's size is checked against Pillow's decompression-bomb limit before the fast path allocates
its pixels, as Pillow checks every image it opens: past ``2 * PIL.Image.MAX_IMAGE_PIXELS`` pixels
the decode is a :class:`~torchpipe.errors.DecodeError` caused by Pillow's
``DecompressionBombError``; past ``MAX_IMAGE_PIXELS`` a ``DecompressionBombWarning`` is issued.
Set ``PIL.Image.MAX_IMAGE_PIXELS`` (``None``: no limit) to change it for both paths.
"""

from __future__ import annotations

import io
import os
import struct
import warnings

import numpy as np
import torch
from PIL import Image

from torchpipe.errors import DecodeError
from torchpipe.runtime.counts import COUNTS

try:
    import simplejpeg
except ImportError:  # no wheel for this platform: Pillow decodes everything
    simplejpeg = None

ImageData = bytes | bytearray | memoryview | np.ndarray | torch.Tensor | str | os.PathLike
"""What the decoders read: the encoded bytes (``bytes``, a 1-D uint8 array or tensor), or a path."""

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCALES = (1, 2, 4, 8)
"""The DCT scalings libjpeg-turbo and Pillow's ``draft`` share: decode at 1/k of the size."""
_ORIENTATION_TAG = 0x0112


class EncodedImage:
    """An image's bytes and the file they came from (for errors), read once."""

    __slots__ = ("data", "path")

    def __init__(self, data: ImageData) -> None:
        self.path: str | None = None
        if isinstance(data, (str, os.PathLike)):
            self.path = os.fsdecode(data)
            self.data: bytes | memoryview = read_file(self.path)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            self.data = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        elif isinstance(data, (np.ndarray, torch.Tensor)):
            array = data.numpy() if isinstance(data, torch.Tensor) else data
            if array.dtype != np.uint8 or array.ndim != 1:
                raise TypeError(
                    f"encoded image data must be a 1-D uint8 array or tensor, got {array.dtype} "
                    f"of shape {tuple(array.shape)}"
                )
            self.data = np.ascontiguousarray(array).data.cast("B")
        else:
            raise TypeError(
                f"an image must be bytes, a 1-D uint8 array or tensor, or a path; got {type(data).__name__}"
            )

    def fail(self, what: str, cause: BaseException | None = None) -> DecodeError:
        where = f" ({self.path})" if self.path else ""
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        return DecodeError(f"{what}{where}{detail}", self.path)

    def head(self, n: int) -> bytes:
        return bytes(self.data[:n])


def read_file(path: str) -> bytes:
    """The bytes of the file at ``path``, read with one ``read`` of its size: a third less CPU
    than ``open(path, "rb").read()``'s buffered file object for an image of ~30 KB.

    Raises:
        OSError: as ``open`` and ``read`` do (FileNotFoundError, IsADirectoryError, ...), naming
            the file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size) if size else b""
        if len(data) < size or not size:  # a short read, or a file whose size stat does not know
            chunks = [data]
            while chunk := os.read(fd, max(size, 1 << 16)):
                chunks.append(chunk)
            data = b"".join(chunks)
        return data
    except OSError as e:
        raise type(e)(e.errno, e.strerror, path) from None
    finally:
        os.close(fd)


def check_channels(channels: int) -> None:
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")


def image_format(image: EncodedImage) -> str:
    """``"jpeg"``, ``"png"`` or ``"other"`` (what Pillow may still read), from the first bytes."""
    head = image.head(8)
    if head.startswith(JPEG_MAGIC):
        return "jpeg"
    if head.startswith(PNG_MAGIC):
        return "png"
    return "other"


def jpeg_size(image: EncodedImage) -> tuple[int, int]:
    """(height, width) from the JPEG header, without decoding."""
    try:
        if simplejpeg is not None:
            height, width, _, _ = simplejpeg.decode_jpeg_header(image.data)
            return int(height), int(width)
    except ValueError:
        pass  # Pillow may still read it
    try:
        with Image.open(io.BytesIO(image.data)) as im:
            return im.height, im.width
    except Exception as e:
        raise image.fail("cannot read the JPEG header", e) from e


def exif_orientation(data: bytes | memoryview) -> int:
    """The EXIF orientation (1-8) of a JPEG, read from its APP1 segment; 1 where it has none."""
    pos, end = 2, len(data)
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker in (0xDA, 0xD9):  # start of scan, end of image: no more headers
            break
        length = (data[pos + 2] << 8) | data[pos + 3]
        segment = bytes(data[pos + 4 : pos + 2 + length])
        if marker == 0xE1 and segment.startswith(b"Exif\x00\x00"):
            return _tiff_orientation(segment[6:])
        pos += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    try:
        order = "<" if tiff[:2] == b"II" else ">"
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for k in range(count):
            tag, _, _ = struct.unpack_from(order + "HHI", tiff, ifd + 2 + 12 * k)
            if tag == _ORIENTATION_TAG:
                (value,) = struct.unpack_from(order + "H", tiff, ifd + 2 + 12 * k + 8)
                return value if 1 <= value <= 8 else 1
    except struct.error:
        pass  # a damaged EXIF block: as if it had none
    return 1


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` (HWC) turned as EXIF ``orientation`` says, to be seen upright (as Pillow's
    ``ImageOps.exif_transpose``)."""
    if orientation == 2:
        return image.flip(1)
    if orientation == 3:
        return image.flip((0, 1))
    if orientation == 4:
        return image.flip(0)
    if orientation == 5:
        return image.permute(1, 0, 2).contiguous()
    if orientation == 6:
        return torch.rot90(image, -1, (0, 1)).contiguous()
    if orientation == 7:
        return image.permute(1, 0, 2).flip((0, 1))
    if orientation == 8:
        return torch.rot90(image, 1, (0, 1)).contiguous()
    return image


def check_pixels(image: EncodedImage) -> None:
    """Refuse a JPEG whose header claims more pixels than Pillow would open (its
    ``MAX_IMAGE_PIXELS``, read at each call), before anything is allocated for them.

    Raises:
        DecodeError: past twice the limit, from a ``PIL.Image.DecompressionBombError``.
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None or simplejpeg is None:
        return  # no limit; or no fast path, and Pillow checks its own opens
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(image.data)
    except ValueError:
        return  # no header the fast path reads: Pillow decodes it, and checks it
    pixels = int(height) * int(width)
    if pixels > 2 * limit:
        bomb = Image.DecompressionBombError(
            f"the image has {pixels} pixels ({width}x{height}), more than twice "
            f"PIL.Image.MAX_IMAGE_PIXELS ({limit}): it could be a decompression "
            "bomb; raise that limit (None: no limit) to decode it"
        )
        raise image.fail("refusing to decode the JPEG", bomb) from bomb
    if pixels > limit:
        warnings.warn(
            f"the JPEG{f' {image.path}' if image.path else ''} has {pixels} pixels, more than "
            f"PIL.Image.MAX_IMAGE_PIXELS ({limit}): it could be a decompression bomb",
            Image.DecompressionBombWarning,
            stacklevel=3,
        )


def decode_jpeg_array(
    image: EncodedImage, channels: int, scale: int = 1, count: bool = True, fast_dct: bool = False
) -> np.ndarray:
    """The JPEG decoded at 1/``scale`` of its size (one of :data:`SCALES`), HWC uint8; the fast
    path first, Pillow for what it refuses (counted, as every decode is unless ``count`` is off).
    ``fast_dct``: libjpeg-turbo's fast integer IDCT (Pillow has none: its fallback stays accurate)."""
    if image_format(image) != "jpeg":
        raise image.fail(
            f"not a JPEG: it starts with {image.head(8)!r} (tp.image.decode_image reads any format)"
        )
    check_pixels(image)
    fast_error: BaseException | None = None
    if simplejpeg is not None:
        try:
            pixels = _simplejpeg(image, channels, scale, fast_dct)
            if count:
                COUNTS.add("images_decoded")
            return pixels
        # malformed, truncated, or damage libjpeg-turbo's strict mode refuses
        except ValueError as e:
            fast_error = e
    pixels = pillow_array(image, channels, scale, fast_error)
    if count:
        COUNTS.add("images_decoded")
        if fast_error is not None:
            COUNTS.add("images_fallback")
    return pixels


def _simplejpeg(image: EncodedImage, channels: int, scale: int, fast_dct: bool) -> np.ndarray:
    colorspace = "RGB" if channels == 3 else "GRAY"
    if scale == 1:
        return simplejpeg.decode_jpeg(image.data, colorspace=colorspace, fastdct=fast_dct)
    height, width, _, _ = simplejpeg.decode_jpeg_header(image.data)
    # the smallest scaling whose size is at least (height // scale, width // scale) is 1/scale
    return simplejpeg.decode_jpeg(
        image.data,
        colorspace=colorspace,
        fastdct=fast_dct,
        min_height=max(1, height // scale),
        min_width=max(1, width // scale),
    )


def pillow_array(
    image: EncodedImage, channels: int, scale: int = 1, fast_error: BaseException | None = None
) -> np.ndarray:
    """Decode with Pillow (any format it reads; JPEG at 1/``scale`` through ``draft``), HWC uint8."""
    try:
        with Image.open(io.BytesIO(image.data)) as im:
            if scale > 1 and im.format == "JPEG":
                im.draft(None, (max(1, im.width // scale), max(1, im.height // scale)))
            pixels = np.asarray(_as_mode(im, "RGB" if channels == 3 else "L"))
    except Exception as e:
        what = "cannot decode the image"
        if fast_error is not None:
            what += f" (libjpeg-turbo: {fast_error}; Pillow too)"
        raise image.fail(what, e) from e
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def decode_other(image: EncodedImage, channels: int) -> torch.Tensor:
    """An image in a format other than JPEG, decoded by Pillow (and counted), HWC uint8."""
    pixels = as_tensor(pillow_array(image, channels))
    COUNTS.add("images_decoded")
    return pixels


def _as_mode(im: Image.Image, mode: str) -> Image.Image:
    """``im`` in ``mode``; alpha is dropped (as ``tf.image.decode_png`` with ``channels=3``)."""
    if im.mode == mode:
        im.load()
        return im
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")  # Pillow converts a palette with transparency through RGBA
    return im.convert(mode)


def as_tensor(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy())

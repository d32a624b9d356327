"""Small images of the kinds real data sets hold, written with Pillow."""

import io

import numpy as np
import pytest
from PIL import Image


def photo(height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    """A smooth RGB image with mild noise, so it compresses like a photo."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    smooth = np.asarray(
        Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16
    )
    return np.clip(smooth + rng.integers(-8, 9, size=smooth.shape), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str = "JPEG", **params) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def with_orientation(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, quality=90, exif=exif)


def refused_by_libjpeg_turbo_strict(data: bytes) -> bytes:
    """``data`` with two stray bytes before its first DQT marker: libjpeg-turbo warns ("extraneous
    bytes before marker"), which its strict mode (simplejpeg's) refuses and Pillow reads past."""
    pos = 4 + ((data[4] << 8) | data[5])  # past APP0
    return data[:pos] + b"\x12\x34" + data[pos:]


@pytest.fixture(scope="session")
def kinds() -> dict[str, bytes]:
    """JPEGs by kind (RGB, grayscale, CMYK, progressive), a PNG and a truncated JPEG."""
    rgb = Image.fromarray(photo())
    files = {
        "rgb": encode(rgb, quality=90),
        "grayscale": encode(rgb.convert("L"), quality=90),
        "cmyk": encode(rgb.convert("CMYK"), quality=90),
        "progressive": encode(rgb, quality=90, progressive=True),
        "png": encode(rgb, "PNG"),
    }
    files["truncated"] = files["rgb"][: len(files["rgb"]) // 2]
    return files

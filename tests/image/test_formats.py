"""The codec under tp.image's decoders: EXIF orientation, and DCT-scaled decodes against Pillow's."""

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

import torchpipe as tp
from tests.image.conftest import photo, with_orientation
from torchpipe.image import formats


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_when_asked_as_pillow_applies_it(orientation):
    image = Image.fromarray(photo(40, 56))
    data = with_orientation(image, orientation)
    upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert formats.exif_orientation(data) == orientation
    assert np.array_equal(tp.image.decode_jpeg(data, apply_exif_orientation=True).numpy(), upright)
    assert tp.image.decode_jpeg(data).shape == (40, 56, 3)  # not applied by default
    assert tp.image.decode_image(data, apply_exif_orientation=True).shape == upright.shape


def test_a_file_without_exif_or_with_a_damaged_block_has_orientation_one(kinds):
    assert formats.exif_orientation(kinds["rgb"]) == 1
    data = with_orientation(Image.fromarray(photo()), 6)
    start = data.index(b"Exif\x00\x00") + 6
    damaged = data[: start + 4] + b"\xff\xff\xff\x7f" + data[start + 8 :]  # IFD offset past the end
    assert formats.exif_orientation(damaged) == 1


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_dct_scaled_decodes_agree_with_pillows_draft(kinds, scale):
    image = formats.EncodedImage(kinds["rgb"])
    fast = formats.decode_jpeg_array(image, 3, scale)
    slow = formats.pillow_array(image, 3, scale)
    assert fast.shape == slow.shape == (-(-48 // scale), -(-64 // scale), 3)
    assert np.abs(fast.astype(int) - slow).max() <= 1


def test_a_file_is_read_whole_and_a_missing_one_is_named(tmp_path):
    data = bytes(range(256)) * 300
    (tmp_path / "a.jpg").write_bytes(data)
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert formats.read_file(str(tmp_path / "a.jpg")) == data
    assert formats.read_file(str(tmp_path / "empty.jpg")) == b""
    with pytest.raises(FileNotFoundError, match="missing.jpg"):
        tp.image.decode_jpeg(tmp_path / "missing.jpg")
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        formats.read_file(str(tmp_path))

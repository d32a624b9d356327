"""``tp.image`` decoders: Pillow's pixels on every kind of file, the fallback, errors, EXIF, DCT scaling."""

import io
import os
import signal

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp
from tests.image.conftest import encode, photo, refused_by_libjpeg_turbo_strict, with_orientation
from torchpipe.image import formats


def pillow(data: bytes, mode: str = "RGB") -> np.ndarray:
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert(mode))
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


@pytest.mark.parametrize("kind", ["rgb", "grayscale", "progressive", "cmyk"])
@pytest.mark.parametrize("channels", [3, 1])
def test_jpeg_pixels_are_pillows(kinds, kind, channels):
    out = tp.image.decode_jpeg(kinds[kind], channels=channels)
    assert out.dtype == torch.uint8 and out.shape == (48, 64, channels)
    diff = np.abs(
        out.numpy().astype(int) - pillow(kinds[kind], "RGB" if channels == 3 else "L")
    ).max()
    # CMYK's conversion, and grayscale from a color file (libjpeg-turbo's luma against Pillow's
    # RGB-to-L formula), differ by rounding
    assert diff <= (1 if kind == "cmyk" or (channels == 1 and kind != "grayscale") else 0)


def test_every_input_kind_decodes_alike(kinds, tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(kinds["rgb"])
    expected = tp.image.decode_jpeg(kinds["rgb"])
    array = np.frombuffer(kinds["rgb"], dtype=np.uint8).copy()
    for data in (
        str(path),
        path,
        bytearray(kinds["rgb"]),
        memoryview(kinds["rgb"]),
        array,
        torch.from_numpy(array),
    ):
        assert torch.equal(tp.image.decode_jpeg(data), expected)
    with pytest.raises(TypeError, match="1-D uint8"):
        tp.image.decode_jpeg(np.zeros((2, 2), np.uint8))
    with pytest.raises(TypeError, match="bytes, a 1-D uint8 array or tensor, or a path"):
        tp.image.decode_jpeg(12)
    with pytest.raises(ValueError, match="channels"):
        tp.image.decode_jpeg(kinds["rgb"], channels=4)


def test_png_and_other_formats(kinds):
    assert np.array_equal(tp.image.decode_png(kinds["png"]).numpy(), pillow(kinds["png"]))
    rgba = Image.fromarray(photo()).convert("RGBA")
    assert np.array_equal(
        tp.image.decode_png(encode(rgba, "PNG")).numpy(), pillow(encode(rgba, "PNG"))
    )
    for fmt in ("PNG", "BMP", "GIF", "WEBP"):
        data = encode(Image.fromarray(photo()), fmt)
        assert np.array_equal(tp.image.decode_image(data).numpy(), pillow(data))
    assert np.array_equal(tp.image.decode_image(kinds["rgb"]).numpy(), pillow(kinds["rgb"]))
    assert tp.image.decode_image(kinds["png"], channels=1).shape == (48, 64, 1)


def test_the_wrong_format_names_the_right_decoder(kinds):
    with pytest.raises(tp.image.DecodeError, match="not a JPEG.*decode_image"):
        tp.image.decode_jpeg(kinds["png"])
    with pytest.raises(tp.image.DecodeError, match="not a PNG"):
        tp.image.decode_png(kinds["rgb"])
    with pytest.raises(tp.image.DecodeError, match="cannot decode"):
        tp.image.decode_image(b"not an image at all")


def test_a_truncated_file_is_an_error_naming_it(kinds, tmp_path):
    path = tmp_path / "cut.jpg"
    path.write_bytes(kinds["truncated"])
    with pytest.raises(tp.image.DecodeError, match="cut.jpg") as info:
        tp.image.decode_jpeg(str(path))
    assert info.value.path == str(path) and isinstance(info.value, ValueError)
    with pytest.raises(tp.image.DecodeError):
        tp.image.decode_and_random_resized_crop(kinds["truncated"], 16)


def test_in_a_pipeline_the_error_names_the_element_and_ignore_errors_skips_exactly_it(
    kinds, tmp_path
):
    paths = []
    for i in range(6):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(
            kinds["truncated"]
            if i in (2, 4)
            else encode(Image.fromarray(photo(seed=i)), quality=90)
        )
        paths.append(str(path))
    ds = tp.from_iterable(paths).map(lambda p: (p, tp.image.decode_jpeg(p)), num_parallel_calls=2)
    with pytest.raises(tp.image.DecodeError, match="2.jpg") as info:
        list(ds)
    assert "element 2" in info.value.__notes__[0]
    assert [p for p, _ in ds.ignore_errors()] == [paths[i] for i in (0, 1, 3, 5)]


def test_what_the_fast_decoder_refuses_pillow_decodes_and_stats_count(kinds):
    damaged = refused_by_libjpeg_turbo_strict(kinds["rgb"])
    if formats.simplejpeg is not None:
        with pytest.raises(ValueError):
            formats.simplejpeg.decode_jpeg(damaged)
    it = iter(tp.from_iterable([kinds["rgb"], damaged, kinds["rgb"]]).map(tp.image.decode_jpeg))
    out = list(it)
    assert all(np.array_equal(x.numpy(), pillow(kinds["rgb"])) for x in out)
    images = it.stats().images
    assert images == {"decoded": 3, "fallback": 1 if formats.simplejpeg is not None else 0}
    assert (
        "3 decoded by tp.image, 1 of them by Pillow" in str(it.stats())
        or formats.simplejpeg is None
    )


def test_without_simplejpeg_pillow_decodes_everything(kinds, monkeypatch):
    monkeypatch.setattr(formats, "simplejpeg", None)
    for kind in ("rgb", "grayscale", "progressive"):
        assert np.array_equal(tp.image.decode_jpeg(kinds[kind]).numpy(), pillow(kinds[kind]))
    assert tp.image.decode_and_random_resized_crop(
        kinds["rgb"], 8, rng=np.random.default_rng(0)
    ).shape == (8, 8, 3)


def _decode_or_die(data: bytes, marker: str) -> torch.Tensor:
    image = tp.image.decode_jpeg(data)
    if not os.path.exists(marker):  # the first call to get here kills its worker (once)
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return image


def test_counts_from_worker_processes_reach_the_pass_and_a_killed_one_loses_only_its_task(
    kinds, tmp_path
):
    ds = tp.from_iterable([kinds["rgb"]] * 12).map(
        tp.image.decode_jpeg, num_parallel_calls=2, executor="process"
    )
    it = iter(ds)
    assert len(list(it)) == 12 and it.stats().images == {"decoded": 12, "fallback": 0}
    marker = str(tmp_path / "killed")
    ds = tp.from_iterable([kinds["rgb"]] * 12).map(
        lambda d: _decode_or_die(d, marker), num_parallel_calls=2, executor="process"
    )
    it = iter(ds)
    assert len(list(it)) == 12  # the killed worker's task ran again on its replacement
    assert it.stats().images["decoded"] == 12  # the decode of the killed task was lost with it


def test_decode_and_crop_is_decode_then_crop(kinds):
    full = tp.image.decode_jpeg(kinds["rgb"])
    out = tp.image.decode_and_crop_jpeg(kinds["rgb"], (5, 7, 20, 30))
    assert torch.equal(out, full[5:25, 7:37]) and out.is_contiguous()
    with pytest.raises(ValueError, match="not inside the 48x64 image"):
        tp.image.decode_and_crop_jpeg(kinds["rgb"], (40, 0, 20, 10))
    with pytest.raises(ValueError, match="not inside"):
        tp.image.decode_and_crop_jpeg(kinds["rgb"], (0, 0, 0, 10))
    rotated = with_orientation(Image.fromarray(photo()), 6)  # stored 48x64, seen 64x48
    upright = tp.image.decode_jpeg(rotated, apply_exif_orientation=True)
    assert torch.equal(
        tp.image.decode_and_crop_jpeg(rotated, (50, 0, 14, 48), apply_exif_orientation=True),
        upright[50:64],
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path is tested in tests/cuda")
def test_decoding_on_a_gpu_without_cuda_says_so(kinds):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        tp.image.decode_jpeg(kinds["rgb"], device="cuda")
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        tp.image.decode_jpeg(kinds["rgb"], device="meta")


def test_the_fast_idct_is_close_and_on_request(kinds):
    accurate = tp.image.decode_jpeg(kinds["rgb"])
    fast = tp.image.decode_jpeg(kinds["rgb"], fast_dct=True)
    assert fast.shape == accurate.shape and 0 < (fast.int() - accurate.int()).abs().max() <= 8
    assert torch.equal(tp.image.decode_image(kinds["rgb"], fast_dct=True), fast)
    assert torch.equal(
        tp.image.decode_and_crop_jpeg(kinds["rgb"], (0, 0, 8, 8), fast_dct=True), fast[:8, :8]
    )


def _with_size(data: bytes, height: int, width: int) -> bytes:
    """``data`` with its frame header (SOF0) claiming ``height`` x ``width``: only the header changes."""
    sof = data.index(b"\xff\xc0")
    return data[: sof + 5] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + data[sof + 9 :]


def test_a_jpeg_header_claiming_too_many_pixels_is_refused_before_decoding():
    # 3.6e9 pixels, ~11 GB decoded
    huge = _with_size(encode(Image.fromarray(photo())), 60000, 60000)
    for decode in (tp.image.decode_jpeg, tp.image.decode_image):
        with pytest.raises(tp.image.DecodeError, match="refusing to decode the JPEG") as error:
            decode(huge)
        assert isinstance(error.value.__cause__, Image.DecompressionBombError)
        assert "MAX_IMAGE_PIXELS" in str(error.value)


def test_the_pixel_limit_is_pillows_and_can_be_changed(monkeypatch):
    data = encode(Image.fromarray(photo(48, 64)))  # 3072 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(tp.image.DecodeError) as error:
        tp.image.decode_jpeg(data)
    assert isinstance(error.value.__cause__, Image.DecompressionBombError)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    with pytest.warns(Image.DecompressionBombWarning):
        assert tp.image.decode_jpeg(data).shape == (48, 64, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert tp.image.decode_jpeg(data).shape == (48, 64, 3)

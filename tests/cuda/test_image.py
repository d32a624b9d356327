"""``tp.image.decode_jpeg(..., device="cuda")``: nvJPEG through torchvision, against the CPU decode."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def jpeg(seed: int, mode: str = "RGB", **params) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize(
        (96, 64), Image.BICUBIC
    )
    buf = io.BytesIO()
    image.convert(mode).save(buf, "JPEG", quality=90, **params)
    return buf.getvalue()


def test_a_batch_decodes_on_the_gpu_close_to_the_cpu():
    pytest.importorskip("torchvision")
    files = [jpeg(i) for i in range(8)] + [
        jpeg(9, "L"),
        jpeg(10, progressive=True),
        jpeg(11, "CMYK"),
    ]
    out = tp.image.decode_jpeg(files, device="cuda")
    assert len(out) == len(files)
    for data, image in zip(files, out):
        assert image.is_cuda and image.dtype == torch.uint8 and image.shape == (64, 96, 3)
        cpu = tp.image.decode_jpeg(data)
        # nvJPEG's IDCT and upsampling are not libjpeg-turbo's: close, not equal
        assert (image.cpu().float() - cpu.float()).abs().mean() < 2
    one = tp.image.decode_jpeg(files[0], device="cuda")
    assert torch.equal(one, out[0])

"""WebDataset fields decoded and encoded by extension: defaults, overrides, errors, round trips."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp
from torchpipe.io.decoders import SampleDecoder, encode_field, extension_of


def test_images_decode_through_tp_image_channels_first_as_pillow_reads_them():
    pixels = np.cumsum(
        np.random.default_rng(0).integers(0, 40, (48, 64, 3), dtype=np.uint8),
        axis=1,
        dtype=np.uint8,
    )
    decode = tp.io.DEFAULT_DECODERS["jpg"]
    for mode, form in (("RGB", "JPEG"), ("L", "JPEG"), ("RGBA", "PNG"), ("P", "GIF")):
        buffer = io.BytesIO()
        Image.fromarray(pixels).convert(mode).save(buffer, form)
        data = buffer.getvalue()
        chw = decode(data)
        assert chw.dtype == torch.uint8 and chw.shape == (3, 48, 64) and chw.is_contiguous()
        assert torch.equal(chw, tp.image.decode_image(data).permute(2, 0, 1))
        with Image.open(io.BytesIO(data)) as image:
            assert torch.equal(
                chw, torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
            ), mode
    with pytest.raises(tp.image.DecodeError):
        decode(b"no image")


def test_npy_pickles_are_refused():
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        tp.io.SampleDecoder()({"__key__": "k", "npy": buffer.getvalue()})


def test_the_last_part_of_a_fields_extension_lower_cased_chooses():
    assert [extension_of(f) for f in ("jpg", "input.PNG", "a.b.Cls", "")] == [
        "jpg",
        "png",
        "cls",
        "",
    ]
    sample = {"__key__": "k", "__url__": "u", "x.TXT": b"hi", "odd": b"\x00"}
    assert SampleDecoder()(sample) == {
        "__key__": "k",
        "__url__": "u",
        "x.TXT": "hi",
        "odd": b"\x00",
    }


def test_an_override_by_any_case_replaces_or_turns_off_a_default():
    decode = SampleDecoder({"TXT": bytes.upper, "cls": None, "bin": len})
    sample = decode({"txt": b"hi", "cls": b"7", "bin": b"abc"})
    assert sample == {"txt": b"HI", "cls": b"7", "bin": 3}
    with pytest.raises(TypeError, match="the decoder for 'png' must be callable or None"):
        SampleDecoder({"png": 3})


def test_a_failing_decoder_keeps_its_error_and_notes_the_field_sample_and_shard():
    with pytest.raises(ValueError) as raised:
        SampleDecoder()({"__key__": "k1", "__url__": "s.tar", "cls": b"seven"})
    assert raised.value.__notes__ == ["decoding field 'cls' of sample 'k1' from s.tar"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cls", 7),
        ("txt", "h\u00e9"),
        ("json", [1, {"x": None}]),
        ("score.jsn", 0.5),
        ("pth", {"w": torch.tensor([1.5, -2.0])}),
        ("bin", b"\x00\x01"),
    ],
)
def test_an_encoded_field_decodes_to_its_value(field, value):
    decoded = SampleDecoder({"bin": None})({field: encode_field(field, value)})[field]
    if field == "pth":
        assert torch.equal(decoded["w"], value["w"])
    else:
        assert decoded == value


def test_arrays_and_images_encode_by_their_extension():
    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    for value in (array, torch.from_numpy(array)):
        decoded = SampleDecoder()({"npy": encode_field("npy", value)})["npy"]
        assert decoded.dtype == torch.int16 and decoded.tolist() == array.tolist()
    image = torch.arange(18, dtype=torch.uint8).reshape(3, 2, 3) * 10
    for ext in ("png", "tiff"):
        assert torch.equal(SampleDecoder()({ext: encode_field(ext, image)})[ext], image)
    assert encode_field("cls", memoryview(b"12")) == b"12"  # bytes are written as they are


def test_a_value_no_encoder_takes_is_refused():
    for field, value in (("cls", True), ("bin", {1}), ("npy", [1, 2])):
        with pytest.raises(TypeError, match=f"no encoder for a {type(value).__name__}"):
            encode_field(field, value)

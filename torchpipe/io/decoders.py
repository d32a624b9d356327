"""Decoding and encoding the fields of WebDataset samples, chosen by extension.

The mapping (the last dot-separated part of a field's extension, lower-cased, chooses)::

    jpg jpeg png ppm pgm pbm bmp gif tif tiff webp -> uint8 tensor [3, H, W], RGB (tp.image)
    cls cls2 index inx id                          -> int
    txt text transcript                            -> str (UTF-8)
    json jsn                                       -> json.loads
    npy                                            -> tensor (numeric) or numpy array (no pickles)
    npz                                            -> dict of the same
    pth pt                                         -> torch.load(weights_only=True)
    anything else                                  -> bytes, unchanged

``__key__``, ``__url__`` and other ``__``-fields pass through. :class:`SampleDecoder` takes
overrides (a function for an extension, or ``None`` to keep its bytes).
"""

from __future__ import annotations

import io
import json
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchpipe.errors import add_note
from torchpipe.image import decode_image

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "bmp", "gif", "tif", "tiff", "webp")
_PIL_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "tif": "TIFF", "tiff": "TIFF"}


def decode_image_chw(data: bytes) -> torch.Tensor:
    """An image file's pixels as a ``uint8`` tensor ``[3, H, W]`` (RGB, channels first, as
    WebDataset's ``torchrgb8``): ``tp.image.decode_image``'s pixels (JPEG through libjpeg-turbo,
    the rest through Pillow; ``tp.image.DecodeError`` for what is no image), channels first."""
    return decode_image(data, channels=3).permute(2, 0, 1).contiguous()


def decode_int(data: bytes) -> int:
    """A class label or index written as decimal text."""
    return int(data.decode().strip())


def decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def decode_json(data: bytes) -> Any:
    return json.loads(data)


def _tensor_or_array(array: np.ndarray) -> Any:
    return torch.from_numpy(np.ascontiguousarray(array)) if array.dtype.kind in "biufc" else array


def decode_npy(data: bytes) -> Any:
    """A ``.npy`` array as a tensor (numeric dtypes) or numpy array; pickled objects are refused."""
    return _tensor_or_array(np.load(io.BytesIO(data), allow_pickle=False))


def decode_npz(data: bytes) -> dict[str, Any]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: _tensor_or_array(archive[name]) for name in archive.files}


def decode_torch(data: bytes) -> Any:
    """A ``torch.save`` file, loaded with ``weights_only=True`` (no arbitrary code)."""
    return torch.load(io.BytesIO(data), weights_only=True)


DEFAULT_DECODERS: Mapping[str, Callable[[bytes], Any]] = types.MappingProxyType(
    {
        **dict.fromkeys(IMAGE_EXTENSIONS, decode_image_chw),
        **dict.fromkeys(("cls", "cls2", "index", "inx", "id"), decode_int),
        **dict.fromkeys(("txt", "text", "transcript"), decode_text),
        **dict.fromkeys(("json", "jsn"), decode_json),
        "npy": decode_npy,
        "npz": decode_npz,
        "pth": decode_torch,
        "pt": decode_torch,
    }
)


def extension_of(field: str) -> str:
    """What chooses a field's decoder: the last part of its extension, lower-cased."""
    return field.rsplit(".", 1)[-1].lower()


class SampleDecoder:
    """Decodes each field of a WebDataset sample by its extension (module docstring's mapping).

    Args:
        decoders: overrides, extension -> function of the bytes (``None``: keep the bytes).

    Errors from a decoder keep their type and get a note naming the field, the sample's key and
    its shard.
    """

    __name__ = "decode"

    def __init__(self, decoders: Mapping[str, Callable[[bytes], Any] | None] | None = None) -> None:
        table: dict[str, Callable[[bytes], Any] | None] = dict(DEFAULT_DECODERS)
        for ext, fn in (decoders or {}).items():
            if fn is not None and not callable(fn):
                raise TypeError(f"SampleDecoder: the decoder for {ext!r} must be callable or None")
            table[ext.lower()] = fn
        self._decoders = table

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for field, value in sample.items():
            fn = None if field.startswith("__") else self._decoders.get(extension_of(field))
            if fn is None:
                out[field] = value
                continue
            try:
                out[field] = fn(value)
            except Exception as e:
                add_note(
                    e,
                    f"decoding field {field!r} of sample {sample.get('__key__')!r} from {sample.get('__url__')}",
                )
                raise
        return out


# -- encoding (TarWriter) ---------------------------------------------------------------------------
def encode_field(field: str, value: Any) -> bytes:
    """A sample field's bytes for a tar member named ``<key>.<field>``: the inverse of the
    decoders (``bytes`` are written as they are).

    Raises:
        TypeError: for a value the field's extension has no encoder for.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    ext = extension_of(field)
    if ext in IMAGE_EXTENSIONS and isinstance(value, (Image.Image, torch.Tensor, np.ndarray)):
        return _encode_image(ext, value)
    if ext in ("json", "jsn"):
        return json.dumps(value).encode()
    if ext == "npy" and isinstance(value, (torch.Tensor, np.ndarray)):
        buffer = io.BytesIO()
        np.save(
            buffer, value.numpy() if isinstance(value, torch.Tensor) else value, allow_pickle=False
        )
        return buffer.getvalue()
    if ext in ("pth", "pt"):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value).encode()
    raise TypeError(
        f"TarWriter: no encoder for a {type(value).__name__} in field {field!r}; pass bytes"
    )


def _encode_image(ext: str, value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        value = value.permute(1, 2, 0).numpy() if value.ndim == 3 else value.numpy()
    image = Image.fromarray(value) if isinstance(value, np.ndarray) else value
    buffer = io.BytesIO()
    image.save(buffer, format=_PIL_FORMATS.get(ext, ext.upper()))
    return buffer.getvalue()

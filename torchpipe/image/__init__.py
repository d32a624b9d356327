"""``tp.image``: image decoding and augmentation that run without the GIL.

Decoders give uint8 tensors of shape (height, width, channels); ``to_tensor`` and ``normalize``
turn them into float (channels, height, width) tensors. The heavy part of every op (libjpeg-turbo's
decode, torch's kernels) releases the GIL, so a ``map`` of them runs in parallel on threads, with
no worker processes and no copies between them; ``num_parallel_calls=tp.AUTOTUNE`` measures that
and puts them there. Random ops draw from ``tp.rng()``, so a pipeline's output is the same for
any executor, worker count and resume. ``train_transform`` is image classification's training
transform (decode, random resized crop, flip, normalize) in one op that writes each image straight
into its batch. docs/image.md documents each op.

    ds = (tp.list_files("train/*/*.jpg", shuffle=True)
            .map(lambda path: tp.image.to_tensor(
                tp.image.random_flip_left_right(
                    tp.image.decode_and_random_resized_crop(path, 224)), MEAN, STD),
                 num_parallel_calls=tp.AUTOTUNE)
            .batch(256))
"""

from torchpipe.errors import DecodeError
from torchpipe.image.decode import decode_and_crop_jpeg, decode_image, decode_jpeg, decode_png
from torchpipe.image.resized_crop import (
    decode_and_random_resized_crop,
    random_resized_crop,
    random_resized_crop_window,
)
from torchpipe.image.train import train_transform
from torchpipe.image.transforms import (
    center_crop,
    crop,
    flip_left_right,
    normalize,
    random_crop,
    random_flip_left_right,
    resize,
    to_tensor,
)

__all__ = [
    "DecodeError",
    "center_crop",
    "crop",
    "decode_and_crop_jpeg",
    "decode_and_random_resized_crop",
    "decode_image",
    "decode_jpeg",
    "decode_png",
    "flip_left_right",
    "normalize",
    "random_crop",
    "random_flip_left_right",
    "random_resized_crop",
    "random_resized_crop_window",
    "resize",
    "to_tensor",
    "train_transform",
]

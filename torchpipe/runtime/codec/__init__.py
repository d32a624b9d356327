"""What crosses a process boundary: an element as one flat record (tensors and arrays raw, the rest
pickle-5 with out-of-band buffers), and many small elements as columns. The record layout is in
:mod:`~torchpipe.runtime.codec.records`."""

from torchpipe.runtime.codec.pickling import StackedTensor, stackable
from torchpipe.runtime.codec.records import (
    EncodedRecord,
    decode,
    decode_bytes,
    decode_view,
    encode,
    encode_bytes,
    materialize,
)

__all__ = [
    "EncodedRecord",
    "StackedTensor",
    "decode",
    "decode_bytes",
    "decode_view",
    "encode",
    "encode_bytes",
    "materialize",
    "stackable",
]

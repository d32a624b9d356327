"""Record formats and files: TFRecord (with ``tf.train.Example`` parsing and an index for random
access), WebDataset tar shards, and remote paths through fsspec. Readers are sources; writers
are plain classes. See docs/formats.md.
"""

from torchpipe.io.files import DataLossError, expand_braces
from torchpipe.io.remote import RemoteReadError, RetryPolicy
from torchpipe.io.tfrecord import TFRecordDataset, TFRecordWriter, masked_crc

__all__ = [
    "DataLossError",
    "RemoteReadError",
    "RetryPolicy",
    "TFRecordDataset",
    "TFRecordWriter",
    "expand_braces",
    "masked_crc",
]

"""Record formats and files: TFRecord (with ``tf.train.Example`` parsing and an index for random
access), WebDataset tar shards, and remote paths through fsspec. Readers are sources; writers
are plain classes. See docs/formats.md.
"""

from torchpipe.io.decoders import DEFAULT_DECODERS, SampleDecoder
from torchpipe.io.example import (
    FixedLenFeature,
    FixedLenSequenceFeature,
    Ragged,
    VarLenFeature,
    parse_example,
    parse_single_example,
    parse_single_sequence_example,
    serialize_example,
    serialize_sequence_example,
)
from torchpipe.io.files import DataLossError, expand_braces, split_files
from torchpipe.io.index import TFRecordRecords, tfrecord_index
from torchpipe.io.remote import RemoteReadError, RetryPolicy
from torchpipe.io.tfrecord import TFRecordDataset, TFRecordWriter
from torchpipe.io.tfrecord_framing import masked_crc
from torchpipe.io.webdataset import TarWriter, from_webdataset
from torchpipe.saved import SavedDataset
from torchpipe.storage.saved_file import SavedFormatError, SavedRecords

__all__ = [
    "DEFAULT_DECODERS",
    "DataLossError",
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "Ragged",
    "RemoteReadError",
    "RetryPolicy",
    "SampleDecoder",
    "SavedDataset",
    "SavedFormatError",
    "SavedRecords",
    "TFRecordDataset",
    "TFRecordRecords",
    "TFRecordWriter",
    "TarWriter",
    "VarLenFeature",
    "expand_braces",
    "from_webdataset",
    "masked_crc",
    "parse_example",
    "parse_single_example",
    "parse_single_sequence_example",
    "serialize_example",
    "serialize_sequence_example",
    "split_files",
    "tfrecord_index",
]

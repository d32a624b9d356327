"""torchpipe: tf.data-style input pipelines and a drop-in DataLoader for PyTorch."""

from torchpipe import distributed, image, io
from torchpipe.constants import AUTOTUNE, INFINITE, UNKNOWN
from torchpipe.dataset import Dataset
from torchpipe.errors import (
    CheckpointError,
    DiskFullError,
    StallError,
    UntrustedTypeError,
    WorkerError,
)
from torchpipe.integrations.ray_data import from_ray
from torchpipe.io import TFRecordDataset, from_webdataset
from torchpipe.loader import DataLoader, explain
from torchpipe.ops.map import pure
from torchpipe.options import AutotuneOptions, DistributeOptions, Options
from torchpipe.randomness import rng
from torchpipe.runtime.codec.restricted import (
    add_safe_globals,
    clear_safe_globals,
    get_safe_globals,
)
from torchpipe.runtime.ray.executor import RayExecutor
from torchpipe.saved import load
from torchpipe.shared_sequence import SharedSequence
from torchpipe.sources import (
    choose_from_datasets,
    from_dataset,
    from_iterable,
    from_tensor_slices,
    list_files,
    range,
    sample_from_datasets,
    zip,
)

__version__ = "0.1.0"

__all__ = [
    "AUTOTUNE",
    "AutotuneOptions",
    "CheckpointError",
    "DataLoader",
    "Dataset",
    "DiskFullError",
    "DistributeOptions",
    "INFINITE",
    "Options",
    "RayExecutor",
    "SharedSequence",
    "StallError",
    "TFRecordDataset",
    "UNKNOWN",
    "UntrustedTypeError",
    "WorkerError",
    "add_safe_globals",
    "choose_from_datasets",
    "clear_safe_globals",
    "distributed",
    "explain",
    "from_dataset",
    "from_iterable",
    "from_ray",
    "from_tensor_slices",
    "from_webdataset",
    "get_safe_globals",
    "image",
    "io",
    "list_files",
    "load",
    "pure",
    "range",
    "rng",
    "sample_from_datasets",
    "zip",
]

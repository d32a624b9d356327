"""The workloads of a benchmark run, by name (``bench/run.py --workloads``): those of
``bench/workloads.py`` (issue #33's ``blobs`` beside ``records``), issue #22's ``tfrecord``
(``bench/tfrecord.py``, built on them) and issue #61's training-transform workloads
(``bench/training.py``: ``train_jpeg``, ``train_tfrecord``).

``DEFAULT`` is what a run measures without ``--workloads``: every workload but the
training-transform ones, so the default full run stays within its 45-minute budget (issue #57);
they run on their own with ``--workloads train_jpeg,train_tfrecord``.
"""

from __future__ import annotations

from bench import tpimage, training
from bench import workloads as wl
from bench.tfrecord import tfrecord

WORKLOADS = {
    "jpeg": wl.jpeg,
    "bigtensor": wl.bigtensor,
    "tiny": wl.tiny_elements,
    "records": wl.records,
    "blobs": wl.blobs,
    "text": wl.text,
    "latency": wl.latency,
    "cache": wl.cache,
    "tfrecord": tfrecord,
    "train_jpeg": training.train_jpeg,
    "train_tfrecord": training.train_tfrecord,
}
TRAINING = tuple(training.KINDS)
"""The training-transform workloads, measured only when named (``--workloads``)."""
DEFAULT = tuple(name for name in WORKLOADS if name not in TRAINING)
"""The workloads a run measures when ``--workloads`` is not given."""

# Their torchpipe_tpimage rows: bench/run.py measures a workload's tp.image pipeline where
# bench/tpimage.py's PIPELINES has one.
tpimage.PIPELINES.update(training.PIPELINES)

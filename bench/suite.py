"""The workloads of a benchmark run, by name (``bench/run.py --workloads``): those of
``bench/workloads.py`` (issue #33's ``blobs`` beside ``records``) and issue #22's ``tfrecord``
(``bench/tfrecord.py``, built on them)."""

from __future__ import annotations

from bench import workloads as wl
from bench.tfrecord import tfrecord

WORKLOADS = {"jpeg": wl.jpeg, "bigtensor": wl.bigtensor, "tiny": wl.tiny_elements, "records": wl.records,
             "blobs": wl.blobs, "text": wl.text, "latency": wl.latency, "cache": wl.cache,
             "tfrecord": tfrecord}  # fmt: skip

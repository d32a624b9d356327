"""tf.data's adapter: the workload's Python item through ``tf.py_function``, and native pipelines.

Two kinds of configuration:

* ``tfdata_autotune`` and the grid behind ``tfdata_best``: ``tf.data.Dataset.range(n).map(
  tf.py_function(item))`` with ``num_parallel_calls`` AUTOTUNE (tf.data's zero-knob setting),
  then ``batch`` (``padded_batch`` for ``text``) and ``prefetch(AUTOTUNE)``; the grid adds
  ``tf.numpy_function`` (the same call without eager tensors: 2.4x the calls a second of
  ``py_function`` on ``tiny``) and thread counts ``n`` (``num_parallel_calls=n`` on a private
  pool of ``n`` threads: tf.data's default pool has a thread a core, which caps calls that wait,
  as ``latency``'s reads do, at that many in flight whatever ``num_parallel_calls`` says). Quick,
  the grid is AUTOTUNE for both and ``numpy_function`` on the most threads. The item is the same
  Python callable every other configuration runs; the call holds the GIL, as any Python thread
  does.
* ``tfdata_native``: the same work in TensorFlow's own ops where TensorFlow has them, which run
  in C++ without the GIL: ``jpeg`` (``read_file``, ``decode_jpeg``, ``random_crop``,
  ``random_flip_left_right``), ``bigtensor`` (``fill``), ``tiny`` (``range``, ``cast``, a
  multiply), ``tfrecord`` (``TFRecordDataset``, ``parse_single_example``, the jpeg ops) and
  ``cache`` (the jpeg ops with ``cache()`` after decode: ``tfdata_native_cache_epoch1/2``),
  ``train_jpeg`` and ``train_tfrecord`` (TensorFlow's decode-and-crop training recipe,
  ``bench/training.py``).
  ``text`` (a Python tokenizer), ``records`` (Python dicts) and ``latency`` (a Python reader)
  have no native variant.

Batches leave TensorFlow as torch tensors viewing the TF tensors' memory (``np.asarray`` of an
eager tensor does not copy; ``.numpy()`` would), strings as NumPy arrays of bytes.

TensorFlow is imported when the first pipeline is made, after every other configuration ran:
its thread pools then cannot be inherited by worker processes forked later.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from bench import peer_items, training
from bench import workloads as wl
from bench.tfrecord import CYCLE

NATIVE = "tfdata_native"
CACHE_EPOCHS = ("tfdata_native_cache_epoch1", "tfdata_native_cache_epoch2")


def import_tensorflow() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter
    import tensorflow as tf

    return tf


def configs(work: wl.Workload, quick: bool) -> list[peer_items.PeerConfig]:
    """tf.data's configurations of ``work``: AUTOTUNE, a grid of thread counts, native ops."""
    items = peer_items.items_of(work)
    threads = sorted({n for n, executor in peer_items.grid_of(work, quick) if executor == "thread"})
    out = []
    for function in ("py_function", "numpy_function"):
        counts = threads if not quick else threads[-1:] if function == "numpy_function" else []
        for calls in [None, *counts]:
            knobs = {
                "function": function,
                "num_parallel_calls": "AUTOTUNE" if calls is None else calls,
            }
            zero_knob = function == "py_function" and calls is None
            build = partial(_python, items, function, calls)
            out.append(
                peer_items.PeerConfig(
                    knobs,
                    partial(peer_items.one_pass, build),
                    epochs=build,
                    name="tfdata_autotune" if zero_knob else None,
                )
            )
    if work.name == "cache":
        once = _Once(lambda: _native_jpeg(work.files, work.batch_size, len(work.files), cache=True))
        out += [
            peer_items.PeerConfig(
                {"num_parallel_calls": "AUTOTUNE", "cache": "after decode"},
                once,
                name=name,
                in_best=False,
            )
            for name in CACHE_EPOCHS
        ]
    elif work.name in _NATIVE:
        build = _NATIVE[work.name]
        out.append(
            peer_items.PeerConfig(
                {"num_parallel_calls": "AUTOTUNE", "ops": "TensorFlow's"},
                partial(_native, build, work),
                name=NATIVE,
                in_best=False,
            )
        )
    return out


class _Once:
    """One tf.data pipeline, built on the first call and iterated again on each later one
    (``cache()`` fills on the first epoch and replays on the next)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build, self.dataset = build, None

    def __call__(self) -> peer_items.PeerIterator:
        if self.dataset is None:
            self.dataset = self.build()
        return _iterate(self.dataset)


def _iterate(dataset: Any) -> peer_items.PeerIterator:
    holder = {"iterator": iter(dataset)}

    def stop() -> None:
        holder.clear()  # tf.data stops an iterator's threads when it is garbage collected

    return peer_items.PeerIterator(_Forward(holder), stop, convert=to_torch)


class _Forward:
    """Iterates ``holder["iterator"]`` until ``stop`` drops it, so no reference outlives it."""

    def __init__(self, holder: dict[str, Any]) -> None:
        self.holder = holder

    def __next__(self) -> Any:
        return next(self.holder["iterator"])


def to_torch(batch: Any) -> Any:
    """A tf.data batch as torch tensors that view its memory (strings: NumPy arrays of bytes)."""
    tf = import_tensorflow()
    with warnings.catch_warnings():
        # The views are read-only as TensorFlow's tensors are; nothing here writes to them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return tf.nest.map_structure(_leaf_to_torch, batch)


def _leaf_to_torch(tensor: Any) -> Any:
    array = np.asarray(tensor)
    return array if array.dtype == object else torch.from_numpy(array)


# -- the Python item through tf.py_function -----------------------------------------------------
def _python(items: peer_items.Items, function: str, parallel: int | None) -> peer_items.PeerEpochs:
    """One dataset over the Python item, iterated each epoch (a user's ``for batch in ds``)."""
    tf = import_tensorflow()
    wrap = getattr(tf, function)  # tf.py_function or tf.numpy_function: (func, inp, Tout)
    calls = tf.data.AUTOTUNE if parallel is None else parallel
    sample = items.fn(0)
    if items.fan_out:
        sample = items.collate(sample)  # fn(i) returns a list: TensorFlow gets it stacked
    structure = tf.nest.map_structure(lambda leaf: 0, sample)
    specs = [_spec(tf, leaf) for leaf in tf.nest.flatten(sample)]
    fn, collate, fan_out = items.fn, items.collate, items.fan_out

    def call(i: Any) -> list[Any]:
        value = fn(int(i))
        return [_leaf_to_tf(leaf) for leaf in tf.nest.flatten(collate(value) if fan_out else value)]

    def item(i: Any) -> Any:
        leaves = wrap(call, [i], [dtype for dtype, _ in specs])
        for leaf, (_, rank) in zip(leaves, specs):
            leaf.set_shape([None] * rank)  # py_function forgets shapes; batching needs the rank
        return tf.nest.pack_sequence_as(structure, leaves)

    ds = tf.data.Dataset.range(items.length).map(item, num_parallel_calls=calls)
    if fan_out:
        ds = ds.unbatch()
    if items.collate is wl.pad_collate:
        # pad_collate's (padded ids, lengths), from each sequence and its length
        ds = ds.map(lambda ids: (ids, tf.shape(ids, out_type=tf.int64)[0])).padded_batch(
            items.batch_size
        )
    elif items.collate is torch.utils.data.default_collate:
        ds = ds.batch(items.batch_size)
    else:
        raise TypeError(f"no tf.data batching for collate_fn {items.collate!r}")
    ds = ds.prefetch(tf.data.AUTOTUNE)
    if parallel is not None:
        options = tf.data.Options()
        # the default, a thread a core, caps calls
        options.threading.private_threadpool_size = parallel
        ds = ds.with_options(options)
    return peer_items.PeerEpochs(partial(_iterate, ds))


def _spec(tf: Any, leaf: Any) -> tuple[Any, int]:
    """The TensorFlow dtype and rank of one leaf of the Python item."""
    if isinstance(leaf, (str, bytes)):
        return tf.string, 0
    array = leaf.numpy() if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
    if isinstance(leaf, int) and not isinstance(leaf, bool):
        array = np.asarray(leaf, dtype=np.int64)  # torch collates Python ints to int64
    return tf.as_dtype(array.dtype), array.ndim


def _leaf_to_tf(leaf: Any) -> Any:
    if isinstance(leaf, str):
        return leaf.encode()
    return leaf.numpy() if isinstance(leaf, torch.Tensor) else leaf


# -- native pipelines: TensorFlow's own ops --------------------------------------------------
def _native(build: Callable[[wl.Workload], Any], work: wl.Workload) -> peer_items.PeerIterator:
    return _iterate(build(work))


def _decode(tf: Any, paths: Any, i: Any) -> tuple[Any, Any]:
    """File ``i % len(paths)`` decoded to HWC uint8 RGB, and its label (``DecodeJpeg``'s)."""
    data = tf.io.read_file(tf.gather(paths, i % tf.size(paths, out_type=tf.int64)))
    return tf.io.decode_jpeg(data, channels=3), i % 1000


def _augment(tf: Any, image: Any, label: Any) -> tuple[Any, Any]:
    """A random 224 crop and flip, CHW (``workloads.augment``'s)."""
    crop = tf.image.random_flip_left_right(tf.image.random_crop(image, (wl.CROP, wl.CROP, 3)))
    return tf.transpose(crop, (2, 0, 1)), label


def _native_jpeg(files: list[str], batch: int, length: int, cache: bool = False) -> Any:
    tf = import_tensorflow()
    paths = tf.constant(files)
    ds = tf.data.Dataset.range(length)
    if cache:
        ds = ds.map(lambda i: _decode(tf, paths, i), num_parallel_calls=tf.data.AUTOTUNE).cache()
        ds = ds.map(
            lambda image, label: _augment(tf, image, label), num_parallel_calls=tf.data.AUTOTUNE
        )
    else:
        ds = ds.map(
            lambda i: _augment(tf, *_decode(tf, paths, i)), num_parallel_calls=tf.data.AUTOTUNE
        )
    return ds.batch(batch).prefetch(tf.data.AUTOTUNE)


def _jpeg(work: wl.Workload) -> Any:
    return _native_jpeg(work.files, work.batch_size, len(work.dataset))


def _bigtensor(work: wl.Workload) -> Any:
    tf = import_tensorflow()

    def fill(i: Any) -> Any:
        return tf.fill((3, wl.CROP, wl.CROP), tf.cast(i % 251, tf.float32))

    ds = tf.data.Dataset.range(len(work.dataset)).map(fill, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(work.batch_size).prefetch(tf.data.AUTOTUNE)


def _tiny(work: wl.Workload) -> Any:
    tf = import_tensorflow()

    def four(i: Any) -> Any:
        return tf.cast(tf.range(i, i + 4), tf.float32) * 0.5

    ds = tf.data.Dataset.range(len(work.dataset)).map(four, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(work.batch_size).prefetch(tf.data.AUTOTUNE)


def _tfrecord(work: wl.Workload) -> Any:
    """Issue #22's seed pipeline: shards interleaved 8 at a time, parsed, decoded, cropped."""
    tf = import_tensorflow()
    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record: Any) -> Any:
        parsed = tf.io.parse_single_example(record, spec)
        return _augment(tf, tf.io.decode_jpeg(parsed["image"], channels=3), parsed["label"])

    files = tf.data.Dataset.from_tensor_slices(work.files).repeat()
    records = files.interleave(
        tf.data.TFRecordDataset, cycle_length=CYCLE, num_parallel_calls=tf.data.AUTOTUNE
    )
    ds = records.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(work.batch_size).prefetch(tf.data.AUTOTUNE)


_NATIVE: dict[str, Callable[[wl.Workload], Any]] = {
    "jpeg": _jpeg,
    "bigtensor": _bigtensor,
    "tiny": _tiny,
    "tfrecord": _tfrecord,
    "train_jpeg": training.native,
    "train_tfrecord": training.native,
}

"""Functions that start a pipeline (``tp.from_dataset``, ``tp.range``, ...) or combine several."""

from __future__ import annotations

import glob
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from torchpipe import nest
from torchpipe.arguments import require_bool, require_int, require_seed
from torchpipe.dataset import Dataset, _check_dataset
from torchpipe.ops.combine import ChooseFromDatasetsNode, SampleFromDatasetsNode, ZipNode
from torchpipe.ops.source_nodes import (
    FileListNode,
    FromDatasetNode,
    FromIterableNode,
    RangeNode,
    TensorSlicesNode,
)


def from_dataset(dataset: Any) -> Dataset:
    """A pipeline over a map-style dataset: ``dataset[0], dataset[1], ..., dataset[len-1]``.

    Args:
        dataset: anything with ``__getitem__`` and ``__len__`` (a ``torch.utils.data.Dataset``).

    Raises:
        TypeError: for an IterableDataset (use :func:`from_iterable`) or an object without
            ``__getitem__`` and ``__len__``.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            "from_dataset: got an IterableDataset; use tp.from_iterable() for iterables"
        )
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            f"from_dataset: expected a map-style dataset with __getitem__ and __len__, got {type(dataset).__name__}"
        )
    return Dataset(FromDatasetNode(dataset))


def from_iterable(iterable: Iterable[Any] | Callable[[], Iterable[Any]]) -> Dataset:
    """A pipeline over an iterable, or over what a zero-argument callable returns.

    A callable is called again for every pass (epoch or repetition), so a generator function
    gives a fresh generator each time. Resuming a checkpoint re-creates the iterable and skips
    the elements already produced.
    """
    if not callable(iterable) and not isinstance(iterable, Iterable):
        raise TypeError(
            f"from_iterable: expected an iterable or a callable, got {type(iterable).__name__}"
        )
    return Dataset(FromIterableNode(iterable))


def from_tensor_slices(structure: Any) -> Dataset:
    """Slices of ``structure`` along its first dimension, keeping tuple/dict/namedtuple nesting.

    Leaves may be tensors, numpy arrays or lists; all must have the same length.

    Raises:
        ValueError: if the leaves differ in length, or a leaf is a scalar.
    """
    leaves = nest.flatten(structure, lists=False)
    if not leaves:
        raise ValueError("from_tensor_slices: the structure has no components")
    lengths = [_leading_length(leaf) for leaf in leaves]
    if len(set(lengths)) != 1:
        raise ValueError(
            f"from_tensor_slices: components differ in their first dimension: {lengths}"
        )
    return Dataset(TensorSlicesNode(structure, lengths[0]))


def _leading_length(leaf: Any) -> int:
    if isinstance(leaf, (torch.Tensor,)) or hasattr(leaf, "ndim"):
        if leaf.ndim == 0:
            raise ValueError("from_tensor_slices: cannot slice a 0-d component")
        return int(leaf.shape[0])
    if isinstance(leaf, (str, bytes)) or not isinstance(leaf, Sequence):
        raise ValueError(
            f"from_tensor_slices: components must be tensors, arrays or lists, got {type(leaf).__name__}"
        )
    return len(leaf)


def range(*args: int) -> Dataset:  # noqa: A001 - the tf.data name
    """Integers like Python's ``range``: ``tp.range(stop)`` or ``tp.range(start, stop, step=1)``."""
    if not 1 <= len(args) <= 3:
        raise TypeError(f"range: expected 1 to 3 arguments (start, stop, step), got {len(args)}")
    for value in args:
        require_int("range", "argument", value)
    start, stop, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
    if step == 0:
        raise ValueError("range: step must not be zero")
    return Dataset(RangeNode(int(start), int(stop), int(step)))


def list_files(
    pattern: str | Sequence[str], shuffle: bool = False, seed: int | None = None
) -> Dataset:
    """The paths matching glob ``pattern`` (or any of several), sorted unless ``shuffle``.

    A pattern with a scheme (``s3://bucket/train-*.tfrecord``) is globbed through fsspec.

    The glob runs now, so a pattern that matches nothing fails here. On several ranks
    (docs/distributed.md) a pipeline that starts here is split by files: each rank reads its own.

    Raises:
        ValueError: if no file matches.
    """
    patterns = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    if not patterns or not all(isinstance(p, (str, os.PathLike)) for p in patterns):
        raise TypeError(f"list_files: pattern must be a str or a list of str, got {pattern!r}")
    require_bool("list_files", "shuffle", shuffle)
    require_seed("list_files", seed)
    files = sorted({f for p in patterns for f in _glob(os.fspath(p))})
    if not files:
        raise ValueError(f"list_files: no files match {patterns}")
    ds = Dataset(FileListNode(files))
    return ds.shuffle(len(files), seed=seed) if shuffle else ds


def _glob(pattern: str) -> list[str]:
    """Local paths, or URLs (``s3://bucket/train-*``) through fsspec (the ``remote`` extra)."""
    from torchpipe.io import remote

    return remote.glob(pattern) if remote.is_url(pattern) else glob.glob(pattern)


def zip(*datasets: Any) -> Dataset:  # noqa: A001 - the tf.data name
    """Elements of several datasets side by side; stops at the shortest.

    ``tp.zip(a, b)`` and ``tp.zip((a, b))`` yield tuples; ``tp.zip({"x": a, "y": b})`` yields
    dicts; any nesting of tuples, dicts and namedtuples of datasets works the same way, and
    ``tp.zip(a)`` yields ``a``'s elements.

    Raises:
        TypeError: for a list of datasets (use a tuple) or a leaf that is not a Dataset.
    """
    structure = datasets[0] if len(datasets) == 1 else tuple(datasets)
    if any(isinstance(node, list) for node in _containers(structure)):
        raise TypeError("zip: use a tuple, not a list, to zip datasets (as tf.data requires)")
    leaves = nest.flatten(structure)
    if not leaves:
        raise ValueError("zip: expected at least one dataset")
    for leaf in leaves:
        _check_dataset("zip", leaf)
    return Dataset(ZipNode([leaf._node for leaf in leaves], structure))


def _containers(structure: Any) -> list[Any]:
    if not nest.is_container(structure):
        return []
    found = [structure]
    for child in nest.children(structure):
        found.extend(_containers(child))
    return found


def choose_from_datasets(
    datasets: Sequence[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
) -> Dataset:
    """Elements taken from ``datasets[c]`` for each ``c`` that ``choice_dataset`` yields.

    Args:
        stop_on_empty_dataset: end when a chosen dataset is exhausted (tf.data's default);
            if False, choices of exhausted datasets are skipped.

    Raises:
        TypeError: if ``datasets`` is not a non-empty list of Datasets.
        ValueError: (while iterating) if a choice is out of range.
    """
    nodes = _dataset_list("choose_from_datasets", datasets)
    _check_dataset("choose_from_datasets", choice_dataset)
    require_bool("choose_from_datasets", "stop_on_empty_dataset", stop_on_empty_dataset)
    return Dataset(ChooseFromDatasetsNode(nodes, choice_dataset._node, stop_on_empty_dataset))


def sample_from_datasets(
    datasets: Sequence[Dataset],
    weights: Sequence[float] | None = None,
    seed: int | None = None,
    stop_on_empty_dataset: bool = False,
) -> Dataset:
    """Elements drawn at random from ``datasets`` with probabilities ``weights``.

    Args:
        weights: one non-negative number per dataset (normalized); ``None`` is uniform.
        seed: the op's seed (default: derived from the pipeline seed).
        stop_on_empty_dataset: end when the drawn dataset is exhausted; if False (default) the
            exhausted dataset is dropped and the others' weights renormalized.
    """
    nodes = _dataset_list("sample_from_datasets", datasets)
    if weights is None:
        probs = [1.0 / len(nodes)] * len(nodes)
    else:
        probs = _normalized_weights(weights, len(nodes))
    require_seed("sample_from_datasets", seed)
    require_bool("sample_from_datasets", "stop_on_empty_dataset", stop_on_empty_dataset)
    return Dataset(SampleFromDatasetsNode(nodes, probs, seed, stop_on_empty_dataset))


def _dataset_list(op: str, datasets: Any) -> list[Any]:
    if (
        isinstance(datasets, (Dataset, Mapping, str))
        or not isinstance(datasets, Sequence)
        or not datasets
    ):
        raise TypeError(f"{op}: datasets must be a non-empty list of tp.Dataset")
    for ds in datasets:
        _check_dataset(op, ds)
    return [ds._node for ds in datasets]


def _normalized_weights(weights: Any, n: int) -> list[float]:
    values = weights.tolist() if hasattr(weights, "tolist") else list(weights)
    if len(values) != n:
        raise ValueError(f"sample_from_datasets: expected {n} weights, got {len(values)}")
    if not all(isinstance(w, numbers.Real) and float(w) >= 0 for w in values):
        raise ValueError(
            f"sample_from_datasets: weights must be non-negative numbers, got {values}"
        )
    total = float(sum(values))
    if total <= 0:
        raise ValueError("sample_from_datasets: at least one weight must be positive")
    return [float(w) / total for w in values]

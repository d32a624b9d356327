"""``tp.explain``: how a pipeline or a DataLoader is set up and how it will run.

A ``tp.Dataset`` explains itself (graph/explain.py); a DataLoader, torch's or torchpipe's, is
described here: its arguments as written, then the iterator an epoch runs on (each says how it
runs) and the copy to its device.
"""

from __future__ import annotations

import torch

from torchpipe.dataset import Dataset
from torchpipe.loader.dataloader import DataLoader, _LoaderState, _route


def explain(pipeline: Dataset | torch.utils.data.DataLoader) -> str:
    """How ``pipeline`` (a ``tp.Dataset`` or a DataLoader) is set up and how it will run.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(pipeline, Dataset):
        return pipeline.explain()
    if not isinstance(pipeline, torch.utils.data.DataLoader):
        raise TypeError(
            f"explain() takes a tp.Dataset or a DataLoader, got {type(pipeline).__name__}"
        )
    return "\n".join(_loader_lines(pipeline))


def _loader_lines(loader: torch.utils.data.DataLoader) -> list[str]:
    """:func:`explain`'s lines for a DataLoader: its arguments as written, then how it will run."""
    state: _LoaderState | None = loader.__dict__.get("_tp")
    return _written_lines(loader, state) + ["As it will run:"] + _running_lines(loader, state)


def _written_lines(loader: torch.utils.data.DataLoader, state: _LoaderState | None) -> list[str]:
    """The loader as written: its kind, dataset, batching and workers."""
    dataset = loader.dataset
    workers = (
        f"{loader.num_workers} (auto: usable cores to start)"
        if state is not None and state.workers_auto
        else str(loader.num_workers)
    )
    kind = (
        "a tp.Dataset pipeline"
        if isinstance(dataset, Dataset)
        else (
            "an IterableDataset"
            if isinstance(dataset, torch.utils.data.IterableDataset)
            else "a map-style dataset"
        )
    )
    sampler = type(loader.sampler).__name__
    collate = getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__)
    return [
        f"{'tp' if isinstance(loader, DataLoader) else 'torch'} DataLoader as written:",
        f"  dataset: {type(dataset).__name__} ({kind})",
        f"  batch_size={loader.batch_size}, drop_last={loader.drop_last}, sampler: {sampler}, collate_fn: {collate}",
        f"  num_workers={workers}, prefetch_factor={loader.prefetch_factor}, "
        f"persistent_workers={loader.persistent_workers}, pin_memory={loader.pin_memory}",
    ]


def _running_lines(loader: torch.utils.data.DataLoader, state: _LoaderState | None) -> list[str]:
    """How the loader will run: the iterator an epoch runs on, then the copy to its device."""
    if not isinstance(loader, DataLoader):
        lines = ["  torch's own iterator (torch.utils.data.DataLoader)"]
    else:  # the iterator an epoch runs on says how it runs
        route = _route(loader)
        lines = (
            route.describe(loader)
            if route is not None
            else ["  torch's own iterator (a spawn/forkserver context)"]
        )
    if state is not None and state.device is not None and state.device.type != "cpu":
        lines.append(
            f"  then copied to {state.device} ahead of use: pinned buffers, a side CUDA stream"
        )
    return lines

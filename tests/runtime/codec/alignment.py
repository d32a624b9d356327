"""Helpers for tests that check where tensors and arrays from the codec start in memory."""

import numpy as np
import torch

from torchpipe import nest


def data_addresses(element) -> list[int]:
    """The data address of every tensor and array in ``element``, in flattening order."""
    return [
        x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data
        for x in nest.flatten(element)
        if isinstance(x, (torch.Tensor, np.ndarray))
    ]


def misaligned(element) -> list[int]:
    """The data addresses in ``element`` modulo 64 that are not 0 (so [] when all are aligned)."""
    return [a % 64 for a in data_addresses(element) if a % 64]


def aligned_base(record: bytes) -> np.ndarray:
    """The record copied to a 64-byte-aligned writable array, as a ring or segment holds it."""
    raw = np.empty(len(record) + 64, np.uint8)
    start = -raw.ctypes.data % 64
    base = raw[start : start + len(record)]
    base[:] = np.frombuffer(record, np.uint8)
    return base

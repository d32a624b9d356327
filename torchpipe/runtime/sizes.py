"""What an element weighs: the bytes of its tensors, arrays and blobs (a stage's memory in the
model, a result's size before its first placement)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torchpipe import nest

_TEXT = (bytes, bytearray, str)


def element_bytes(element: Any) -> int:
    """Bytes of the tensors, arrays, ``bytes`` and strings in an element (other leaves count as
    nothing); a list of ``bytes`` or strings (a batch's column) is summed at once."""
    if isinstance(element, torch.Tensor):
        return element.numel() * element.element_size()
    if isinstance(element, np.ndarray):
        return element.nbytes
    if isinstance(element, _TEXT):
        return len(element)
    if not nest.is_container(element):
        return 0
    items = nest.children(element)
    if items and type(items[0]) in _TEXT and all(type(item) is type(items[0]) for item in items):
        return sum(map(len, items))
    return sum(element_bytes(item) for item in items)


def heap_bytes(element: Any, mapped: int = 128 << 10) -> int:
    """Bytes of an element that a C heap holds: its ``bytes`` and strings, and its tensors and
    arrays smaller than ``mapped`` (glibc maps larger blocks of their own, freed by unmapping)."""
    if isinstance(element, (torch.Tensor, np.ndarray)):
        nbytes = element_bytes(element)
        return nbytes if nbytes < mapped else 0
    if isinstance(element, _TEXT) or not nest.is_container(element):
        return element_bytes(element)
    return sum(heap_bytes(item, mapped) for item in nest.children(element))

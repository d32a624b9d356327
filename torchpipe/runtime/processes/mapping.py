"""Shared mappings of a received memory file that hold no file descriptor.

``mmap.mmap`` keeps a duplicate of its file's descriptor for as long as it lives (until Python
3.13's ``trackfd=False``), so a consumer that holds results mapped from one-off segments, a
validation loop's outputs or a replay buffer, holds a descriptor for each and meets its
open-files limit (``ulimit -n``) after a few hundred. :func:`map_shared` maps the memory with
the C library's ``mmap`` instead: the caller closes the descriptor at once, and the mapping
goes when the last view of it is freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import weakref
from typing import Any

import numpy as np

_libc: Any = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int, flags: int = mmap.MAP_SHARED) -> memoryview:
    """A writable byte view of the first ``size`` bytes of ``fd``, mapped ``flags``.

    The view (and every view or array made from it) keeps the mapping alive; it is unmapped
    when the last of them is freed. ``fd`` stays the caller's (close it at once).

    Raises:
        ValueError: ``size`` is not positive.
        OSError: the kernel refused the mapping.
    """
    if size <= 0:
        raise ValueError(f"a mapping needs a positive size, got {size}")
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno() or errno.ENOMEM
        raise OSError(code, f"mmap of {size} bytes: {os.strerror(code)}")
    memory = (ctypes.c_ubyte * size).from_address(address)
    # Not at exit: a thread still running then (a prefetch's, say) may read a tensor that views
    # this memory while the interpreter runs its finalizers; the process's end unmaps it anyway.
    weakref.finalize(memory, _libc.munmap, address, size).atexit = False
    array: Any = np.frombuffer(memoryview(memory), np.uint8)
    return memoryview(array)  # a plain byte format, which cast() takes


_LOW_BIT = bytes(b & 1 for b in range(256))


def mapping_address(mapping: mmap.mmap | memoryview) -> int | None:
    """Where a writable mapping starts in this process (None where it is read-only)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    except TypeError:
        return None


def resident_pages(address: int | None, nbytes: int) -> int:
    """How many pages of the shared mapping at ``address`` are in memory, whichever process
    touched them (``mincore``); 0 where it cannot say (gone, or never known)."""
    pages = -(-nbytes // mmap.PAGESIZE)
    if address is None or not pages:
        return 0
    vector = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vector) != 0:
        return 0
    return bytes(vector).translate(_LOW_BIT).count(1)

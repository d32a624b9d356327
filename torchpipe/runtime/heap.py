"""What this process's C heap (glibc's malloc) keeps and gives back: the one place that tunes it.

Three uses, one concern each:

- :func:`hold_free`: the process that takes the batches (the training loop's) keeps two
  batches' worth of freed heap for the next batches. glibc gives freed memory at the top of its
  heap back to the system once more than its trim threshold (128 KiB at first) is free; a batch
  of 32 rows with a 64 KB ``bytes`` each frees 2 MB at once, so every batch was given back and
  faulted in again, page by page: 5x the time of building it (``blobs``' epochs, 18 ms or 90 ms,
  by how the process's allocations happened to start). glibc raises that threshold itself,
  to twice the size of the largest block it mapped and then freed (up to 32 MiB); this maps and
  frees one such block, so its own rule keeps the room, no setting fixed.
- :func:`keep_freed_memory` / :func:`return_freed_memory`: a worker process keeps everything
  it freed (no mapped blocks, no trimming), or goes back to glibc's defaults when a memory budget
  binds.
- :func:`trim_heap`: give back what the heap holds free now (the loader's own inline and thread
  calls' leftovers), when the loader sheds for a budget.
- :func:`give_back_arena`: a pool thread about to end gives back the free top of the heap it
  allocated from (glibc gives each thread an arena of its own, which ``malloc_trim`` leaves).

Elsewhere than glibc (macOS, musl) each is a no-op.
"""

from __future__ import annotations

import ctypes
from typing import Any

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536  # glibc's defaults for them
MAPPED_MAX = 32 << 20
"""The largest freed block glibc raises its thresholds for (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)."""
ARENA_PIECE = 120 * 1024
"""Below glibc's least mmap threshold (128 KiB): a block this size comes from the thread's arena."""

_held = 0  # the most this process was made to hold (inherited by forks: their heap is a copy)


def _libc() -> Any:
    """glibc's functions (``malloc``/``free`` typed for pointers), or None elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt  # noqa: B018 - glibc has it; musl and macOS do not
    except (OSError, AttributeError):
        return None
    return libc


def hold_free(batch_bytes: int) -> None:
    """Let this process's heap keep two batches of ``batch_bytes`` free between batches (the one
    let go while the next is alive: glibc then trims past four), rather than give them back to the
    system and fault them in again (the module's docstring). ``batch_bytes`` is what a batch holds
    in the heap (:func:`~torchpipe.runtime.sizes.heap_bytes`: its blobs, strings and small arrays;
    a large tensor is a block of its own, which glibc maps, and raises its thresholds for by
    itself once freed). Blocks smaller than that are then made from the heap rather than mapped.
    Costs one map and unmap the first time a size is asked for (then nothing); where ``mallopt``
    fixed the thresholds (a worker's :func:`keep_freed_memory`), glibc keeps them."""
    global _held
    size = min(2 * max(int(batch_bytes), 0), MAPPED_MAX)
    if size <= _held:
        return  # two threads asking at once map a block each: no harm
    libc = _libc()
    if libc is not None:
        # a block past the threshold is mapped; freeing it raises the thresholds to its size
        libc.free(libc.malloc(size + 1))
    _held = size


def held() -> int:
    """The room :func:`hold_free` made in this process, in bytes (0: none asked yet)."""
    return _held


def keep_freed_memory() -> None:
    """Make glibc's malloc reuse freed memory in this worker instead of returning it.

    By default every allocation of 32 MB or more (and, after a while, of less) is a fresh
    ``mmap``: each new tensor then pays a page fault per 4 KB page, which made a worker that
    builds 32 MB tensors spend five times longer faulting than filling them. Keeping freed
    memory (no mmap, no trimming) costs a worker's RSS staying at its peak.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def return_freed_memory() -> None:
    """Undo :func:`keep_freed_memory` (glibc's defaults: large blocks are mapped and unmapped,
    freed memory is trimmed) and give back what the heap holds free now (``malloc_trim``): a
    memory budget binds."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)


def trim_heap() -> None:
    """Give back what this process's heap holds free (glibc's ``malloc_trim``): the memory the
    loader's own inline and thread calls left there."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def give_back_arena() -> None:
    """Give back the free top of the arena this thread allocates from: call it on a thread about
    to end (a pool's). glibc gives threads arenas of their own, and gives an arena's free top back
    only where it is larger than the trim threshold, which :func:`hold_free` (and glibc, after a
    large block is freed) raises to tens of MB; ``malloc_trim`` leaves arenas' tops alone. So
    the memory a thread's calls made and freed stayed with the process after the thread ended
    (``tfrecord``'s DataLoader back on worker processes after two threads: 11 MB). This grows
    the arena's top past any threshold glibc sets (twice :data:`MAPPED_MAX`) in blocks it serves
    from the arena, unwritten, and frees them: glibc's own rule then gives the top back, the
    memory left there with it, and ``malloc_trim`` gives back the free blocks below what is
    still in use there (a few small blocks of the interpreter's can sit above them)."""
    libc = _libc()
    if libc is None:
        return
    pieces = [libc.malloc(ARENA_PIECE) for _ in range(2 * MAPPED_MAX // ARENA_PIECE + 1)]
    for piece in pieces:  # in order: each merges with the free one before, the last with the top
        libc.free(piece)
    libc.malloc_trim(0)

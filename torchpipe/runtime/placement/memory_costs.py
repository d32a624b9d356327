"""What memory costs on this machine: a first-touch page fault, and a byte moved between processes.

The policy (:mod:`~torchpipe.runtime.placement.policy`) compares executors on steady costs. Two memory
effects make the first calls of a stage unlike the later ones, and one makes processes dearer
than a call's time says:

- **First-touch page faults.** A call that allocates memory the process never had (the heap
  grows, a fresh mapping) faults each new page in; once results are freed, the allocator hands
  the same pages to later calls, which fault no more. So the faults of the first calls are a
  cold start (:func:`cold_seconds`), except for blocks larger than glibc's largest mmap threshold
  (:data:`MMAP_THRESHOLD_MAX`), which are mapped afresh, and faulted again, every time.
- **Bytes moved.** A result made in a worker is written into its ring there and copied out here,
  from memory another core wrote: each side pays about a copy at the machine's memory bandwidth,
  not the cache speed a decode measured on a hot record shows (:func:`byte_seconds`).

Both rates are measured once per process (:func:`calibrate`, a few milliseconds): when a
loader or a map that places its calls is made, so its first elements do not wait for it.
"""

from __future__ import annotations

import mmap
import resource
import sys
import time

import numpy as np

PAGE = mmap.PAGESIZE
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest dynamic mmap threshold (64-bit): a block above it is mapped on every
allocation and unmapped when freed, so its pages fault in again on every call."""
# mapped and touched to time a fault, half copied onto the other to time a byte
_CALIBRATION_BYTES = 16 << 20
_COPIES = 3
CACHED_BYTES = 1 << 20
"""Results smaller than this move at about the speed a decode measured on a hot record shows (they
stay in a core's cache); larger ones are priced at :func:`byte_seconds`."""
_fault_s: float | None = None
_byte_s: float | None = None
_THREAD_USAGE = getattr(resource, "RUSAGE_THREAD", None)  # Linux


def thread_faults() -> int | None:
    """Minor page faults of the calling thread so far; None where the OS does not count them per thread."""
    if _THREAD_USAGE is None:
        return None
    return resource.getrusage(_THREAD_USAGE).ru_minflt


def fault_seconds() -> float:
    """Seconds one first-touch page fault costs this process."""
    return _fault_s if _fault_s is not None else calibrate()[0]


def byte_seconds() -> float:
    """Seconds one byte costs to copy between buffers about the size of a last-level cache."""
    return _byte_s if _byte_s is not None else calibrate()[1]


def calibrate() -> tuple[float, float]:
    """Measure :func:`fault_seconds` and :func:`byte_seconds` (once a process; ~5 ms): a fresh
    mapping is touched a page at a time, then half of it copied onto the other half (the fastest
    of a few copies)."""
    global _fault_s, _byte_s
    if _fault_s is None or _byte_s is None:
        with mmap.mmap(-1, _CALIBRATION_BYTES) as fresh:
            memory = np.frombuffer(fresh, np.uint8)
            t0 = time.perf_counter()
            memory[::PAGE] = 1  # one write a page: each faults the page in
            _fault_s = (time.perf_counter() - t0) / (_CALIBRATION_BYTES // PAGE)
            half = _CALIBRATION_BYTES // 2
            best = float("inf")
            for _ in range(_COPIES):
                t0 = time.perf_counter()
                np.copyto(memory[half:], memory[:half])
                best = min(best, time.perf_counter() - t0)
            _byte_s = best / half
            del memory
    return _fault_s, _byte_s


def cold_seconds(faults: int, steady_bytes: int = 0) -> float:
    """Seconds of a call's ``faults`` that later calls will not pay: all but the pages of the
    blocks over :data:`MMAP_THRESHOLD_MAX` it made (``steady_bytes``), which fault every time."""
    cold = faults - steady_bytes // PAGE
    return cold * fault_seconds() if cold > 0 and sys.platform.startswith("linux") else 0.0

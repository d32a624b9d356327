"""runtime/heap.py: what this process's C heap keeps between batches and gives back."""

import platform
import subprocess
import sys

import pytest

from torchpipe.runtime import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A batch of 32 rows with a 64 KB bytes each, made and freed 100 times, in a process that imports
# nothing but heap.py (importing torch may leave glibc's thresholds raised already).
_BATCHES = """
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("heap", sys.argv[1])
heap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heap)
if sys.argv[2] == "hold":
    heap.hold_free(32 * 65536)
pool = bytes(1 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    batch = [pool[k * 1000 : k * 1000 + 65536] for k in range(32)]
    del batch
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _BATCHES, heap.__file__, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout)


@glibc
def test_a_heap_held_for_a_batch_is_not_faulted_in_again_at_every_batch():
    pages = 100 * 32 * 65536 // 4096  # what the batches touch
    if _faults("none") < pages // 2:
        pytest.skip("this malloc keeps freed memory between batches by itself")
    assert _faults("hold") < pages // 20


def test_the_room_held_grows_to_two_of_the_largest_batches_and_never_shrinks(monkeypatch):
    monkeypatch.setattr(heap, "_held", 0)
    heap.hold_free(1 << 20)
    assert heap.held() == 2 << 20
    heap.hold_free(1 << 10)  # a smaller batch: the room stays
    assert heap.held() == 2 << 20
    heap.hold_free(1 << 40)  # glibc raises its thresholds no further than 32 MiB
    assert heap.held() == heap.MAPPED_MAX
    heap.hold_free(-1)
    assert heap.held() == heap.MAPPED_MAX


def test_the_heap_calls_are_harmless_where_they_apply(monkeypatch):
    # glibc here: each runs; elsewhere (_libc() is None) each is a no-op
    heap.trim_heap()
    monkeypatch.setattr(heap, "_libc", lambda: None)
    monkeypatch.setattr(heap, "_held", 0)
    heap.hold_free(1 << 20)
    heap.keep_freed_memory()
    heap.return_freed_memory()
    heap.trim_heap()
    assert heap.held() == 2 << 20


def test_what_a_batch_holds_in_the_heap_leaves_out_large_tensors():
    import numpy as np
    import torch

    from torchpipe.runtime.sizes import heap_bytes

    batch = {
        "image": torch.zeros(64, 3, 224, 224, dtype=torch.uint8),  # mapped: a block of its own
        "label": torch.zeros(64, dtype=torch.int64),
        "blob": [bytes(1000)] * 4,
        "name": "abc",
        "small": np.zeros(10, np.float32),
        "n": 3,
    }
    assert heap_bytes(batch) == 64 * 8 + 4000 + 3 + 40


# A thread's calls make and free 24 MB in 150 KB blocks (served from its arena once the trim
# threshold is raised, as hold_free raises it), on a bare thread or a pool's; printed: what the
# process still holds of it, in MB, once the thread ended.
_ARENA = """
import ctypes, sys, threading
from torchpipe.runtime import heap
from torchpipe.runtime.thread_pool import ThreadPool
heap.hold_free(8 << 20)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def calls():
    blocks = [libc.malloc(150_000) for _ in range(160)]
    for block in blocks:
        ctypes.memset(block, 1, 150_000)
    for block in blocks:
        libc.free(block)
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = resident()
if sys.argv[1] == "pool":
    pool = ThreadPool(1, "arena")
    pool.submit(calls).result()
    pool.close()
else:
    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
print((resident() - before) >> 20)
"""


def _left_by_thread(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _ARENA, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(out.stdout)


@glibc
def test_a_pool_thread_gives_back_its_arena_as_it_ends():
    if _left_by_thread("bare") < 16:
        pytest.skip("this malloc gives a thread's freed arena back by itself")
    assert _left_by_thread("pool") < 6

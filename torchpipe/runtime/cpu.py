"""How many CPU cores this process may really use (affinity and cgroup quota), how often a
process has gone to sleep on its own (waiting on I/O, a sleep, a lock), and how long a thread has
waited for a core others held (:func:`run_delay`)."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from typing import TypeVar

from torchpipe.runtime.forks import ForkSafeLock


def usable_cpu_count() -> int:
    """Cores available to this process: the affinity mask, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    quota = cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def cgroup_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 ``cpu.max`` or v1 ``cfs_quota_us``), None if unlimited."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else quota_us / period_us


_INTRA_OP_LOCK = ForkSafeLock()


def one_intra_op_thread() -> None:
    """Make torch ops called from this thread use one intra-op thread; other threads keep theirs.

    Pool threads run torch ops side by side. With torch's default, each call to a parallel op
    (``torch.stack`` of a batch, a large copy) starts an OpenMP team of every core, so N pool
    threads run N x cores threads that spin for one another: two threads stacking image batches
    on 2 cores were 3x slower together than one alone. DataLoader's worker processes set one
    intra-op thread for the same reason. ``torch.set_num_threads`` also sets the process-wide
    default that new threads start with, so that default is put back from a helper thread, which
    leaves this thread's own setting (OpenMP's is per thread) at one.
    """
    import torch

    with _INTRA_OP_LOCK:
        # also runs torch's per-thread setup, which would reset it later
        default = torch.get_num_threads()
        if default == 1:
            return
        torch.set_num_threads(1)
        restore = threading.Thread(
            target=torch.set_num_threads, args=(default,), name="torchpipe-intra-op"
        )
        restore.start()
        restore.join()


@contextlib.contextmanager
def as_a_pool_thread_runs() -> Iterator[None]:
    """Within the block, torch ops called from this thread use one intra-op thread, as they do on
    pool threads (:func:`one_intra_op_thread`) and in worker processes; the setting is put back after.

    For measuring calls inline before they are placed: on this thread torch would split each op
    over every core, and when another core is busy (the probe measuring the GIL, another process)
    the op waits for it, so a call looks slower and as if it waited on I/O, which it would not on a
    pool thread. Threads that first run a torch op during the block start with one intra-op
    thread, as pool threads do anyway.
    """
    import torch

    with _INTRA_OP_LOCK:
        default = torch.get_num_threads()
        if default > 1:
            torch.set_num_threads(1)
    try:
        yield
    finally:
        if default > 1:
            with _INTRA_OP_LOCK:
                torch.set_num_threads(default)


def voluntary_switches(pid: int) -> int:
    """How many times process ``pid``'s main thread gave up its core to wait (I/O, a sleep, a
    lock; being preempted by another process is not counted), from ``/proc/<pid>/status``; 0
    where unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return next(
                (
                    int(line.split()[1])
                    for line in f
                    if line.startswith(b"voluntary_ctxt_switches:")
                ),
                0,
            )
    except (OSError, ValueError):
        return 0


def run_delay(thread_id: int | None = None) -> float | None:
    """Seconds a thread of this process has waited, runnable, for a core held by others (the run
    queue's delay, ``/proc/.../schedstat``: a busy machine's preemption, not the thread's own
    waits); ``thread_id`` is a native thread id (``threading.get_native_id()``), this thread by
    default. None where the kernel does not report it.

    A call's wall time less this delay is what it takes on an idle core: what the placement
    policy should compare, whatever else the machine runs while it measures. This thread's is
    read from a file kept open (~3 us a read, where opening it costs ~25), so every call a pool
    runs can be timed with it.
    """
    if thread_id is None:
        return _OWN_SCHEDSTAT.read()
    try:
        with open(f"/proc/self/task/{thread_id}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


_N = TypeVar("_N", int, float)


def grown(before: _N | None, after: _N | None) -> _N:
    """How much a counter of a thread (:func:`run_delay`, page faults) grew between two
    readings; 0 where the OS does not count it (either reading None)."""
    return after - before if before is not None and after is not None else 0


class _ThreadSchedstat(threading.local):
    """Each thread's ``/proc/thread-self/schedstat``, opened at its first read (closed when the
    thread ends); reopened in a forked child, where an inherited descriptor reads the parent's
    thread."""

    def __init__(self) -> None:
        self.file: _Descriptor | None = None
        self.unreadable = False

    def read(self) -> float | None:
        if self.unreadable:
            return None
        try:
            if self.file is None or self.file.pid != os.getpid():
                self.file = _Descriptor(os.open("/proc/thread-self/schedstat", os.O_RDONLY))
            return int(os.pread(self.file.fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            self.unreadable = True
            return None


class _Descriptor:
    """A file descriptor closed when the last reference to it goes (a thread's local data)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pid = fd, os.getpid()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


_OWN_SCHEDSTAT = _ThreadSchedstat()

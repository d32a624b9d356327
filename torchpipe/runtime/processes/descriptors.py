"""The main process's open-files limit, as the process pool meets it.

Results travel from workers in shared memory whose descriptors are passed over a socket: a
ring's once, a one-off segment's with each result too large for a slot or finding every slot
held. A process at its limit (``RLIMIT_NOFILE``, ``ulimit -n``) receives such a message without
its descriptor. The pool then asks the worker to send that result again in the channel, and
every worker sends its results without descriptors (no segment, no new ring) until the main
process has room again (:class:`DescriptorBudget`); nothing is lost, repeated or reordered.
Where the pool cannot go on (a worker cannot be started, a message lost whole), it raises
:func:`open_files_error`.
"""

from __future__ import annotations

import errno
import os
import resource
import time
from collections.abc import Callable

RECHECK_S = 1.0
"""How often a pool short of descriptors looks whether it has room for them again."""
SPARE_PER_WORKER = 8
"""Descriptors a pool wants free per worker before it lets its workers send them again."""
_SPARE = 32


def open_files_limit() -> int:
    """This process's soft limit on open file descriptors."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_files() -> int:
    """How many file descriptors this process has open."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own


def is_open_files_error(error: BaseException) -> bool:
    """Whether ``error`` is the kernel saying a process (or the system) has too many files open."""
    return isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE)


def open_files_error(stage: str, what: str) -> RuntimeError:
    """The error a user can act on when this process's open-files limit stops a pool.

    Args:
        stage: the stage's name; what: what could not be done (``"start a worker process"``).
    """
    limit = open_files_limit()
    return RuntimeError(
        f"{stage}: too many open files: this process reached its limit of {limit} open file "
        f"descriptors (RLIMIT_NOFILE) and could not {what}. Raise the limit (`ulimit -n` in the "
        "shell, or resource.setrlimit(resource.RLIMIT_NOFILE, ...) in Python), or hold fewer "
        "open files and batches at once. torchpipe's workers hold no descriptor per batch "
        "delivered, so torch.multiprocessing.set_sharing_strategy('file_system'), torch's "
        "advice for its own DataLoader, changes nothing here."
    )


class DescriptorBudget:
    """Whether a pool's workers may pass descriptors to this process, and when to allow them again.

    Args:
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.short = False
        self.shortages = 0  # times the pool found itself short, for stats and tests
        self._checked = 0.0

    def ran_short(self) -> None:
        """A message arrived without its descriptors."""
        self.short = True
        self.shortages += 1
        self._checked = self._now()

    def room_again(self, workers: int) -> bool:
        """Whether a pool that ran short now has room (looked at once a :data:`RECHECK_S`)."""
        if not self.short or self._now() - self._checked < RECHECK_S:
            return False
        self._checked = self._now()
        limit = open_files_limit()
        if (
            limit != resource.RLIM_INFINITY
            and limit - open_files() < _SPARE + SPARE_PER_WORKER * workers
        ):
            return False
        self.short = False
        return True

    def _now(self) -> float:
        return self._clock()

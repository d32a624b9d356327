"""Real limits on writing, for the tests of every writer: a file-size limit and a full disk.

The ``no_room`` fixture (import it into a test module) gives a :class:`NoRoom` twice: ``fsize`` runs
the write in a forked child under ``RLIMIT_FSIZE`` (with ``SIGXFSZ`` ignored, so a write past the
limit gets ``EFBIG`` instead of killing the child), and ``tmpfs`` runs it on a small tmpfs mounted
for the test (a real ``ENOSPC``; skipped where mounting is not allowed). A writer's case is then::

    error = no_room.run(write, path)          # the write, where it runs out of room
    no_room.check(error, f"save({path})")     # a DiskFullError naming the stage, file and bytes
    assert no_room.files() == []              # nothing published, no temporary file left
    no_room.grow()                            # room again: the next write must succeed
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import random
import resource
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

import torchpipe as tp

LIMIT = 1 << 20
"""Bytes a test may write before it runs out of room (the file-size limit; the tmpfs holds 2 MiB)."""
MORE_THAN_LIMIT = 4 * LIMIT
_TIMEOUT_S = 15.0


class NoRoom:
    """A directory where writes run out of room, and a way to give them room again.

    Attributes:
        kind: ``"fsize"`` or ``"tmpfs"``.
        directory: where the test writes.
        errno: what a write past the limit gets (``EFBIG`` or ``ENOSPC``).
    """

    def __init__(self, kind: str, directory: str) -> None:
        self.kind, self.directory = kind, directory
        self.errno = errno.EFBIG if kind == "fsize" else errno.ENOSPC
        self._limited = True

    def run(self, write: Callable[..., Any], *args: Any) -> BaseException | None:
        """Call ``write(*args)`` without room (while limited); the exception it raised, or None."""
        if self.kind == "fsize" and self._limited:
            return _in_limited_child(write, args)
        try:
            write(*args)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return e
        return None

    def check(self, error: BaseException | None, stage: str) -> tp.DiskFullError:
        """Assert that ``error`` is the DiskFullError of ``stage`` that ran out of this room."""
        assert isinstance(error, tp.DiskFullError), f"expected a DiskFullError, got {error!r}"
        assert isinstance(error, OSError) and error.errno == self.errno
        # a cause does not pickle back
        assert isinstance(error.__cause__, OSError) or self.kind == "fsize"
        assert str(error).startswith(f"{stage}: ") and error.stage == stage
        assert (
            f"after writing {error.written:,} bytes to {error.filename}: [Errno {self.errno}]"
            in str(error)
        )
        assert error.filename.startswith(self.directory)
        return error

    def files(self) -> list[str]:
        """Every file under the directory (relative names, sorted), hidden ones included."""
        found = []
        for root, _, names in os.walk(self.directory):
            found += [os.path.relpath(os.path.join(root, name), self.directory) for name in names]
        return sorted(found)

    def grow(self) -> None:
        """Give writes room again (lift the file-size limit, or make the tmpfs larger)."""
        self._limited = False
        if self.kind == "tmpfs":
            subprocess.run(
                ["mount", "-o", "remount,size=64m", self.directory], check=True, timeout=10
            )


def _in_limited_child(write: Callable[..., Any], args: tuple[Any, ...]) -> BaseException | None:
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_limited, args=(sender, write, args))
    child.start()
    sender.close()
    try:
        if not receiver.poll(_TIMEOUT_S):
            raise AssertionError(
                f"the write under the file-size limit did not end within {_TIMEOUT_S} s"
            )
        outcome = pickle.loads(receiver.recv_bytes())
    finally:
        child.join(_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    return outcome


def _limited(sender: Any, write: Callable[..., Any], args: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
    try:
        write(*args)
        outcome: Any = None
    except Exception as e:  # noqa: BLE001 - sent to the test
        outcome = e
    try:
        data = pickle.dumps(outcome)
    except Exception as e:  # noqa: BLE001 - an error that does not pickle is a failure too
        data = pickle.dumps(
            AssertionError(f"the write raised {outcome!r}, which does not pickle: {e}")
        )
    sender.send_bytes(data)


@pytest.fixture(params=["fsize", "tmpfs"])
def no_room(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A :class:`NoRoom` by a file-size limit, then by a full tmpfs."""
    directory = tmp_path / "no-room"
    directory.mkdir()
    if request.param == "fsize":
        yield NoRoom("fsize", str(directory))
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here (needs root and a container that allows it): "
            f"{mounted.stderr.strip()}"
        )
    try:
        yield NoRoom("tmpfs", str(directory))
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=10)


def payload(i: int) -> bytes:
    """Element ``i`` of a write too big for the room: 8 of them are ``MORE_THAN_LIMIT`` bytes
    (random, so that no compression makes them fit)."""
    return random.Random(int(i)).randbytes(MORE_THAN_LIMIT // 8)

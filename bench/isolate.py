"""Each configuration measured in a fresh process: forked from a parent that measures nothing.

``bench/run.py``'s process builds the workloads and their trials and collects the results; it
never iterates a loader. Each measurement (or a few that must share one process: a cache's two
epochs) runs in a child forked from it (:func:`in_fresh_process`), so the heap, the imports, the
worker pools and the process-wide costs a row leaves behind cannot move the memory or the first
decisions of the rows after it (issue #57). The child reads the memory of the tree rooted at its
parent (:func:`tree_root`): the parent's pages are shared with the child and its workers, and
PSS splits a shared page between every process that maps it, so only the whole tree counts each
page once, as it did when every row ran in one process.

OpenMP's thread pool does not survive a fork (libgomp: a child that enters a parallel region its
parent had entered waits for threads it does not have), so the parent keeps torch to one
intra-op thread while it forks rows (:func:`pristine_parent`, entered before it builds anything)
and each child takes back the parent's thread count, starting a pool of its own.

The peers measured last (``bench/run.py``'s ``LAST``: tf.data) are forked from the same parent
after it has imported their library (:func:`preload`), once, after every other row: each of
their rows then costs its measurement, not a TensorFlow import (~5 s a row on the 2-core machine,
about 5 minutes of a full run). The parent still measures nothing, so those rows stay fresh; the
rows before them never share a process with TensorFlow.

A child that raises sends its error back (:class:`RowFailed` in the parent, with the child's
traceback); one that dies, or outlives ``timeout_s``, is killed and reported the same way; one
that outlives it is first asked where its threads are (``faulthandler`` on ``SIGUSR1``), and the
error says (a hung row is a bug to find, not only a row to skip).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import torch

TIMEOUT_S = 600.0
"""How long one child may take before it is killed (a quick row takes ~10 s, a full epoch a minute)."""
JOIN_S = 10.0
STACKS_S = 1.0
"""How long a child past its time is given to write its threads' stacks before it is killed."""

_root: int | None = None
_threads: int | None = None


class RowFailed(RuntimeError):
    """A measurement in a fresh process raised, died or ran past its time; the message says which."""


def tree_root() -> int:
    """The pid whose process tree a measurement reads: the parent that forked this child (see
    the module's docstring), or this process where no fresh process was made."""
    return _root if _root is not None else os.getpid()


@contextmanager
def pristine_parent() -> Iterator[None]:
    """This process as the parent of fresh processes: torch at one intra-op thread (no OpenMP
    pool to break in a fork) until the block ends; each child takes back the thread count."""
    global _threads
    before, _threads = _threads, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(_threads)
        _threads = before


def preload(import_library: Callable[[], Any]) -> float:
    """Import a library in this process (the pristine parent, before it forks the rows that use
    it) by calling ``import_library``; returns the seconds the import took (what each of those
    rows would otherwise pay in its own process)."""
    start = time.perf_counter()
    import_library()
    return time.perf_counter() - start


def in_fresh_process(
    measures: Sequence[Callable[[], Any]], timeout_s: float = TIMEOUT_S
) -> tuple[list[Any], float]:
    """Run ``measures`` one after another in one child forked from this process.

    Returns:
        Each measure's result, in order, and the seconds the child took from the fork to its last
        result (the row's wall time: the measurements and the fresh process's cost together).

    Raises:
        RowFailed: if a measure raised (its type, message and the child's traceback), or the
            child died or ran past ``timeout_s``.
    """
    context = multiprocessing.get_context("fork")
    # Not a daemon: a measurement starts worker processes of its own, which a daemon may not.
    receiver, sender = context.Pipe(duplex=False)
    # Where a child past its time writes its threads' stacks.
    with tempfile.TemporaryFile("w+") as stacks:
        start = time.perf_counter()
        child = context.Process(
            target=_child, args=(sender, list(measures), os.getpid(), stacks), name="bench-row"
        )
        child.start()
        sender.close()
        try:
            if not receiver.poll(timeout_s):
                raise RowFailed(
                    f"the measurement ran past {timeout_s:g} s and was killed; {_where(child, stacks)}"
                )
            try:
                ok, payload = receiver.recv()
            except EOFError as e:
                raise RowFailed(f"the measuring process died (exit code {child.exitcode})") from e
        finally:
            wall = time.perf_counter() - start
            _stop(child)
            receiver.close()
    if not ok:
        raise RowFailed(payload)
    return payload, wall


def _where(child: Any, stacks: Any) -> str:
    """The stacks of a child's threads (asked for with ``SIGUSR1``), then the child killed."""
    if child.pid is not None:
        os.kill(child.pid, signal.SIGUSR1)
    time.sleep(STACKS_S)
    child.kill()
    stacks.seek(0)
    text = stacks.read().strip()
    return f"where its threads were:\n{text}" if text else "it wrote no stacks"


def _child(sender: Connection, measures: list[Callable[[], Any]], parent: int, stacks: Any) -> None:
    global _root
    _root = parent
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if _threads is not None:
        torch.set_num_threads(_threads)
    try:
        results = [measure() for measure in measures]
        sender.send((True, results))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, named
        sender.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        sender.close()
        sys.stdout.flush()
        sys.stderr.flush()
    # No teardown: the parent's atexit hooks are not this child's, and a thread a measurement
    # left running must not hold the row (multiprocessing would join non-daemon threads).
    os._exit(0)


def _stop(child: Any) -> None:
    child.join(JOIN_S)
    if child.is_alive():
        child.kill()
        child.join(JOIN_S)

"""The zygote: a single-threaded process that forks worker processes on request.

The main process forks the zygote once, when a process pool is built and before the pipeline
starts threads. The zygote holds everything the workers need (the pipeline, the user's
functions and datasets, torch already imported), so a worker costs one ``fork`` of a
single-threaded process: no re-import, no pickling of the dataset, and safe while the main
process runs threads.

Lifetime: every worker asks the kernel for SIGKILL when the zygote dies (``PR_SET_PDEATHSIG``),
and the zygote ends when its channel to the main process closes (as the kernel closes it when the
main process dies, even by SIGKILL) or its parent's pid changes, so nothing outlives the main
process. The zygote itself does not ask for the parent-death signal: Linux sends it when the
*thread* that forked it ends, not the process, and the zygote is forked by whichever thread first
needs processes (a prefetch's thread, which ends when the prefetch goes inline, killed the zygote
and every worker with it). The zygote reaps its workers and reports how each one ended. SIGINT is
the main process's to handle (ignored here); SIGTERM ends the zygote or a worker whatever handler
the main process installed, so a worker sent it is a dead worker, replaced as any other.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from torchpipe.runtime.processes.channel import Channel, ChannelClosed, DescriptorsLost
from torchpipe.runtime.recycle import forget_batches_in_fork

_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Arrange SIGKILL when the parent (a single-threaded zygote) dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the pid polling below still ends us
    if os.getppid() != parent_pid:
        os._exit(0)


def describe_exit(status: int) -> str:
    """``killed by SIGKILL`` or ``exited with code 3`` for a ``waitpid`` status."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class ZygoteGone(RuntimeError):
    """The zygote process is gone (killed, or closed)."""


class Zygote:
    """Forks the zygote now; ``spawn`` asks it for a worker.

    Args:
        worker_main: runs in each worker as ``worker_main(channel, worker_id)``; the channel
            is the worker's end of its channel to the main process.
        name: shown in errors.
    """

    def __init__(self, worker_main: Callable[[Channel, int], None], name: str) -> None:
        self.name = name
        self._exits: dict[int, int] = {}
        self._reaped = False
        control, child_end = Channel.pair()
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                control.close()
                _zygote_main(child_end, worker_main, parent)
            except BaseException:  # noqa: BLE001 - the zygote must never return into the caller
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        child_end.close()
        self.pid = pid
        self._control: Channel | None = control

    def spawn(self, worker_id: int, timeout: float = 30.0) -> tuple[int, Channel]:
        """A new worker's pid and the main process's end of its channel.

        Raises:
            ZygoteGone: if the zygote is gone (it can be dead before :meth:`alive` says so).
            RuntimeError: if it does not answer within ``timeout``.
            OSError: this process or the zygote is at its open-files limit (``EMFILE``).
        """
        if self._control is None:
            raise ZygoteGone(f"{self.name}: the zygote process {self.pid} is gone (closed)")
        main_end, worker_end = Channel.pair()
        try:
            self._control.send(("spawn", worker_id), [worker_end.fileno()])
        except ChannelClosed as e:
            main_end.close()
            raise ZygoteGone(f"{self.name}: the zygote process {self.pid} is gone") from e
        finally:
            worker_end.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self._next_message(deadline - time.monotonic())
            if message is not None and message[0] == "spawn_failed" and message[1] == worker_id:
                main_end.close()
                raise OSError(
                    message[2], f"{self.name}: the zygote could not start a worker: {message[3]}"
                )
            if message is not None and message[0] == "spawned" and message[1] == worker_id:
                return message[2], main_end
        main_end.close()
        raise RuntimeError(
            f"{self.name}: the zygote process {self.pid} did not start a worker in {timeout} s"
        )

    def exit_status(self, pid: int, timeout: float) -> int | None:
        """The ``waitpid`` status of worker ``pid`` once the zygote has reaped it, or None
        (also when the zygote itself is gone, and took its workers with it)."""
        deadline = time.monotonic() + timeout
        while (
            pid not in self._exits
            and time.monotonic() < deadline
            and self._control is not None
            and self.alive()
        ):
            try:
                self._next_message(deadline - time.monotonic())
            except ZygoteGone:
                break
        return self._exits.get(pid)

    def alive(self) -> bool:
        """Whether the zygote process still runs (it can be killed like any process)."""
        if self._control is None or self._reaped:
            return False
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done = self.pid
        self._reaped = done != 0
        return not self._reaped

    def _next_message(self, timeout: float) -> tuple | None:
        assert self._control is not None  # asked while the zygote runs
        if not self._control.poll(max(0.0, min(timeout, _POLL_S))):
            return None
        try:
            message, _ = self._control.recv()
        except ChannelClosed as e:
            raise ZygoteGone(f"{self.name}: the zygote process {self.pid} is gone") from e
        if message[0] == "exited":
            self._exits[message[1]] = message[2]
        return message

    def close(self, timeout: float = 5.0) -> None:
        """Stop the zygote; its workers die with it (SIGKILL through the parent-death signal)."""
        if self._control is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._control.close()
        self._control = None
        deadline, pause = (
            time.monotonic() + timeout,
            0.0002,
        )  # SIGKILL takes well under a millisecond
        while not self._reaped and time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done = self.pid
            self._reaped = done != 0
            if not self._reaped:
                time.sleep(pause)
                pause = min(2 * pause, 0.01)


def _zygote_main(
    control: Channel, worker_main: Callable[[Channel, int], None], parent: int
) -> None:
    # no parent-death signal here (module docstring): the channel ends us
    if os.getppid() != parent:
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    # SIGTERM's default action for the zygote and its workers: a handler the main process set
    # (to save a checkpoint) would be inherited and make them ignore SIGTERM; a worker sent it
    # on its own must die and be replaced like any dead worker.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    forget_batches_in_fork()  # the main process's batches: never read here, nor by the workers
    gc.freeze()  # the workers' collections leave alone what they share with this process
    zygote = os.getpid()
    while os.getppid() == parent:
        _report_exits(control)
        if not control.poll(_POLL_S):
            continue
        try:
            message, fds = control.recv()
        except ChannelClosed:
            return
        # the zygote is at its open-files limit: the worker's end is lost
        except DescriptorsLost as e:
            control.send(
                ("spawn_failed", e.message[1], errno.EMFILE, "its channel's descriptor was lost")
            )
            continue
        if message[0] != "spawn":
            return
        pid = os.fork()
        if pid == 0:
            _worker_process(control, fds[0], worker_main, message[1], zygote)
        os.close(fds[0])
        control.send(("spawned", message[1], pid))


def _worker_process(
    control: Channel,
    fd: int,
    worker_main: Callable[[Channel, int], None],
    worker_id: int,
    zygote: int,
) -> None:
    code = 0
    try:
        control.close()
        die_with_parent(zygote)
        worker_main(Channel(socket.socket(fileno=fd)), worker_id)
    except ChannelClosed:
        pass  # the pool let the worker go (closed, or retired it) before it got going: not an error
    except BaseException:  # noqa: BLE001 - report, then leave without unwinding into the zygote
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _report_exits(control: Channel) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            control.send(("exited", pid, status))
        except ChannelClosed:
            return

import os
import signal
import threading
import time

import pytest

from tests.processes import wait_dead
from torchpipe.runtime.processes.channel import Channel
from torchpipe.runtime.processes.zygote import Zygote, describe_exit

CAPTURED = {"value": 0}


def echo_worker(channel: Channel, worker_id: int) -> None:
    channel.send(("hello", worker_id, os.getpid(), os.getppid(), CAPTURED["value"]))
    message, _ = channel.recv()
    if message == "crash":
        os.kill(os.getpid(), signal.SIGKILL)


def test_workers_are_forked_from_the_zygote_with_its_memory():
    CAPTURED["value"] = 42  # set before the zygote forks: workers see it without pickling
    zygote = Zygote(echo_worker, "test")
    try:
        pid, channel = zygote.spawn(7)
        assert channel.poll(10)
        message, _ = channel.recv()
        assert message == ("hello", 7, pid, zygote.pid, 42)
        channel.send("crash")
        status = zygote.exit_status(pid, timeout=5)
        assert status is not None and describe_exit(status) == "killed by SIGKILL"
        channel.close()
    finally:
        zygote.close()
    assert wait_dead([zygote.pid]) == []


def collecting_worker(channel: Channel, worker_id: int) -> None:
    """Collects all garbage, then says how many bytes it holds alone (USS)."""
    import gc

    from torchpipe.loader.memory import private_bytes

    before = private_bytes(os.getpid())
    gc.collect()
    channel.send(("collected", private_bytes(os.getpid()) - before))
    channel.recv()


def test_a_workers_collections_leave_the_parents_objects_shared():
    """A worker's garbage collector writes the header of every object it looks at: each page
    of the main process's objects it shares would be copied into it (a training script's 300k
    dicts: ~70 MB a worker, as torch's DataLoader workers copy them). The zygote freezes what it
    inherited, so the workers' collections skip those objects."""
    graph = [{"i": i, "l": [i]} for i in range(300_000)]
    zygote = Zygote(collecting_worker, "test")
    try:
        _, channel = zygote.spawn(0)
        assert channel.poll(30)
        message, _ = channel.recv()
        assert message[0] == "collected" and message[1] < 16 << 20, message
        channel.send("done")
        channel.close()
    finally:
        zygote.close()
    assert len(graph) == 300_000


def test_a_zygote_forked_by_a_thread_outlives_the_thread():
    """A pipeline's zygote is forked by whichever thread first needs processes (a prefetch's
    thread, which ends when the prefetch goes inline): the zygote and its workers must not die
    with that thread, as a parent-death signal would make them."""
    made = []

    def fork_then_end():
        made.append(Zygote(echo_worker, "test"))
        # the zygote is up (and would have asked for the signal) before the thread ends
        time.sleep(0.3)

    thread = threading.Thread(target=fork_then_end)
    thread.start()
    thread.join()
    (zygote,) = made
    try:
        time.sleep(0.2)  # a signal sent at the thread's end would have landed by now
        assert zygote.alive()
        pid, channel = zygote.spawn(3)
        assert channel.poll(10) and channel.recv()[0][:3] == ("hello", 3, pid)
        channel.send("bye")
        channel.close()
    finally:
        zygote.close()
    assert wait_dead([zygote.pid]) == []


def test_closing_the_zygote_kills_its_workers():
    zygote = Zygote(echo_worker, "test")
    pid, channel = zygote.spawn(0)
    assert channel.poll(10)
    zygote.close()
    assert wait_dead([pid]) == []
    channel.close()
    with pytest.raises(RuntimeError, match="gone"):
        zygote.spawn(1)


def test_describe_exit():
    assert describe_exit(3 << 8) == "exited with code 3"
    assert describe_exit(signal.SIGSEGV) == "killed by SIGSEGV"


def _wait_status(pid: int, timeout: float) -> int:
    """The ``waitpid`` status of child ``pid``; raises TimeoutError if it still runs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still runs after {timeout} s")


def test_workers_and_the_zygote_end_of_sigterm_where_the_parent_has_a_handler():
    # A training script catches SIGTERM to save a checkpoint; the zygote forked after that must
    # not inherit the handler, or a worker sent SIGTERM on its own would live on, ignoring it.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        zygote = Zygote(echo_worker, "test")
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        pid, channel = zygote.spawn(0)
        assert channel.poll(10)
        os.kill(pid, signal.SIGTERM)
        status = zygote.exit_status(pid, timeout=10)
        assert status is not None and describe_exit(status) == "killed by SIGTERM"
        channel.close()
        os.kill(zygote.pid, signal.SIGTERM)
        assert describe_exit(_wait_status(zygote.pid, timeout=10)) == "killed by SIGTERM"
    finally:
        zygote.close()

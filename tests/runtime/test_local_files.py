"""Descriptors of local files, one table a process (``torchpipe/runtime/local_files.py``): a
forked child opens its own, even when the fork came while another thread held the table's lock
(a DataLoader that moved its reads from threads to worker processes hung so)."""

from __future__ import annotations

import os
import pickle
import signal
import threading

from torchpipe.runtime.local_files import ProcessLocalFiles


def _in_child(check) -> int:
    """Fork; run ``check()`` in the child (killed by SIGALRM if it hangs); its exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(10)
        try:
            os._exit(0 if check() else 1)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return status


def test_a_child_forked_while_another_thread_holds_the_lock_opens_its_own(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"abc")
    table = ProcessLocalFiles()
    parent_fd = table.descriptor(0, str(path))
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with table._lock:  # as a thread opening another file at the moment of the fork
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(10)
    try:
        status = _in_child(
            lambda: (
                (fd := table.descriptor(0, str(path))) != parent_fd and os.pread(fd, 3, 0) == b"abc"
            )
        )
    finally:
        release.set()
        thread.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status  # not killed by the alarm
    assert table.descriptor(0, str(path)) == parent_fd  # the parent's table is its own still


def test_a_copy_sent_elsewhere_has_no_descriptors(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x")
    table = ProcessLocalFiles()
    fd = table.descriptor(3, str(path))
    copy = pickle.loads(pickle.dumps(table))
    assert copy._fds == {} and copy.descriptor(3, str(path)) != fd

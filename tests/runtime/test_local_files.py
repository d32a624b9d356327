"""Descriptors of local files, one table a process (``torchpipe/runtime/local_files.py``): a
forked child opens its own, even when the fork came while another thread held the table's lock
(a DataLoader that moved its reads from threads to worker processes hung so)."""

from __future__ import annotations

import os
import pickle

from tests.runtime.test_forks import held_by_another_thread, in_child
from torchpipe.runtime.local_files import ProcessLocalFiles


def test_a_child_forked_while_another_thread_holds_the_lock_opens_its_own(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"abc")
    table = ProcessLocalFiles()
    parent_fd = table.descriptor(0, str(path))

    def opens_its_own() -> bool:
        fd = table.descriptor(0, str(path))
        return fd != parent_fd and os.pread(fd, 3, 0) == b"abc"

    with held_by_another_thread(table._lock):  # as a thread opening another file at the fork
        status = in_child(opens_its_own)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status  # not killed by the alarm
    assert table.descriptor(0, str(path)) == parent_fd  # the parent's table is its own still


def test_a_copy_sent_elsewhere_has_no_descriptors(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x")
    table = ProcessLocalFiles()
    fd = table.descriptor(3, str(path))
    copy = pickle.loads(pickle.dumps(table))
    assert copy.descriptor(3, str(path)) != fd  # opened its own

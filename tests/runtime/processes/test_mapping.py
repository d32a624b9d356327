"""map_shared: a shared mapping of a file that holds no descriptor and goes with its last view."""

import errno
import gc
import mmap
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from torchpipe.runtime.processes.mapping import map_shared

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")


def _file_of(data):
    """A descriptor of an unlinked file holding ``data``."""
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.write(fd, data)
    return fd


def _mapped(address):
    """Whether a mapping starts at ``address`` in this process."""
    with open("/proc/self/maps") as maps:
        return any(int(line.split("-", 1)[0], 16) == address for line in maps)


def test_the_view_reads_and_writes_the_file_after_its_descriptor_is_closed():
    fd = _file_of(b"hello world!" + bytes(mmap.PAGESIZE))
    view = map_shared(fd, 12)
    os.close(fd)
    assert len(view) == 12 and view.format == "B" and bytes(view) == b"hello world!"
    view[:5] = b"HELLO"
    assert bytes(view) == b"HELLO world!"


def test_a_shared_mapping_writes_through_a_private_one_does_not():
    fd = _file_of(b"abcd")
    try:
        map_shared(fd, 4)[0] = ord("x")
        private = map_shared(fd, 4, mmap.MAP_PRIVATE)
        private[1] = ord("y")
        assert bytes(private) == b"xycd" and os.pread(fd, 4, 0) == b"xbcd"
    finally:
        os.close(fd)


def test_the_mapping_holds_no_descriptor_and_goes_with_its_last_view():
    fds = len(os.listdir("/proc/self/fd"))
    fd = _file_of(bytes(2 * mmap.PAGESIZE))
    view = map_shared(fd, 2 * mmap.PAGESIZE)
    os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == fds
    array = np.frombuffer(view, np.uint8)[10:]
    address = array.ctypes.data - 10
    del view
    gc.collect()
    assert _mapped(address)  # the array still views it
    del array
    gc.collect()
    assert not _mapped(address)


def test_a_size_that_is_not_positive_is_refused():
    for size in (0, -1):
        with pytest.raises(ValueError, match="positive size"):
            map_shared(0, size)


def test_a_mapping_the_kernel_refuses_raises_os_error():
    fd, path = tempfile.mkstemp()
    os.write(fd, bytes(mmap.PAGESIZE))
    read_only = os.open(path, os.O_RDONLY)  # a shared, writable mapping needs write access
    os.unlink(path)
    os.close(fd)
    try:
        with pytest.raises(OSError) as raised:
            map_shared(read_only, mmap.PAGESIZE)
        assert raised.value.errno == errno.EACCES
    finally:
        os.close(read_only)


_READ_AT_EXIT = """
import atexit, os, sys, tempfile
read = []
# Registered before weakref's own exit hook, so this runs after the finalizers (atexit is LIFO),
# as a thread still running at exit (a prefetch's) reads its tensors then.
atexit.register(lambda: print("read at exit", bytes(read[0][:5]).decode(), flush=True))
from torchpipe.runtime.processes.mapping import map_shared
fd, path = tempfile.mkstemp()
os.unlink(path)
os.write(fd, b"hello" + bytes(4096))
read.append(map_shared(fd, 4096))
os.close(fd)
"""


def test_a_mapping_still_viewed_at_exit_is_not_unmapped_under_its_reader():
    # A regression: the interpreter's exit ran the unmap of mappings still viewed (weakref
    # finalizers run at exit), under a prefetch thread still collating rows that viewed them.
    done = subprocess.run(
        [sys.executable, "-c", _READ_AT_EXIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "read at exit hello" in done.stdout

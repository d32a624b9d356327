"""Anonymous shared-memory files (memfd): made, sealed, mapped; and the one-off segment of a
result too large for its worker's ring (``shm_ring.py`` builds its rings of them).

Nothing is ever created in ``/dev/shm``: a memfd has no name there, its descriptor travels with
the message that needs it (``socket.send_fds``) or by fork, and the memory goes when the last
mapping and descriptor do.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import weakref

from torchpipe.runtime.processes.mapping import map_shared

MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")


@functools.cache
def memfd_supported() -> bool:
    """Whether this platform can create the anonymous shared-memory files rings are made of."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        os.close(os.memfd_create("torchpipe-probe", os.MFD_CLOEXEC))
    except OSError as e:  # at the open-files limit it is there all the same: the pool says so
        return e.errno in (errno.EMFILE, errno.ENFILE)
    return True


def check_nbytes(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")


def new_memfd(name: str, size: int, allocate: int | None = None) -> int:
    """A sealed anonymous file of ``size`` bytes, its first ``allocate`` bytes' pages (all of them
    by default) allocated now.

    Allocating up front turns a lack of memory into an OSError here rather than a SIGBUS on
    the first write; the seals stop either side from resizing it under the other's mapping.
    """
    if not memfd_supported():
        raise OSError(errno.ENOSYS, "torchpipe shared memory needs Linux memfd_create")
    flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        _allocate(fd, size if allocate is None else allocate)
        _seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _seal(fd: int) -> None:
    if not hasattr(fcntl, "F_ADD_SEALS"):
        return
    seals = 0
    for name in _SEALS:
        seals |= getattr(fcntl, name, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError:
        pass  # sealing is a guard against misuse, not needed for correctness


def map_memfd(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    flags = MAP_FLAGS if populate else mmap.MAP_SHARED
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def unmap(fd: int, mapping: mmap.mmap | memoryview, views: tuple[memoryview, ...]) -> None:
    """Release our views, unmap, close the descriptor.

    A view the caller still holds keeps the mapping alive (mmap refuses to close): it is then
    unmapped when the last such view is freed, so no caller is ever left with a dangling view.
    """
    for view in views:
        try:
            view.release()
        except BufferError:
            pass
    try:
        mapping.close() if isinstance(mapping, mmap.mmap) else mapping.release()
    except BufferError:
        pass
    if fd >= 0:
        os.close(fd)


class OneOffSegment:
    """A memfd segment holding one element too large for the ring; never refused for its size.

    The producer creates, fills and sends ``fd`` (``socket.send_fds``), then closes its side;
    the consumer attaches, copies out and closes. The memory goes when the last side closes.

    Attributes:
        fd: the segment's descriptor, owned by this object (-1 once attached: the mapping needs none).
        nbytes: payload size.
        buffer: writable memoryview of exactly ``nbytes`` bytes (page-aligned).
    """

    def __init__(self, fd: int, mapping: mmap.mmap | memoryview, nbytes: int) -> None:
        """Wrap a mapped segment; use :meth:`create` or :meth:`attach` instead."""
        self.fd = fd
        self.nbytes = nbytes
        whole = memoryview(mapping)
        self.buffer = whole[:nbytes]
        self._finalizer = weakref.finalize(self, unmap, fd, mapping, (self.buffer, whole))

    @classmethod
    def create(cls, nbytes: int) -> OneOffSegment:
        """A new segment of ``nbytes`` bytes.

        Raises:
            ValueError: ``nbytes`` is not an int >= 0.
            OSError: memfd is unsupported, or the memory cannot be allocated.
        """
        check_nbytes(nbytes)
        size = max(nbytes, 1)  # mmap cannot map zero bytes
        fd = new_memfd("torchpipe-segment", size)
        try:
            mapping = map_memfd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mapping, nbytes)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> OneOffSegment:
        """Map the segment behind ``fd`` (received from its creator) and close ``fd``: a result
        the consumer holds holds a mapping, not a descriptor (open-files limit).

        Raises:
            ValueError: the segment is smaller than ``nbytes``.
        """
        check_nbytes(nbytes)
        size = os.fstat(fd).st_size
        if size < max(nbytes, 1):
            raise ValueError(f"fd {fd}: segment of {size} bytes cannot hold {nbytes} bytes")
        mapping = map_shared(fd, max(nbytes, 1), MAP_FLAGS)
        os.close(fd)
        return cls(-1, mapping, nbytes)

    def close(self) -> None:
        """Unmap and close the descriptor; idempotent."""
        self._finalizer()

    def __enter__(self) -> OneOffSegment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OneOffSegment(nbytes={self.nbytes}, fd={self.fd})"

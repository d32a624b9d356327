"""A message channel between two processes: pickled objects and file descriptors.

A ``Channel`` wraps one end of an ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair, which keeps message
boundaries and attaches passed file descriptors to the message they were sent with. Messages are
small control records (a sequence number, an offset, a length); a message too large for one
datagram travels in an anonymous memory file whose descriptor rides along instead.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
from typing import Any

_INLINE_LIMIT = 64 * 1024
_RECV_BYTES = _INLINE_LIMIT + 1024
_MAX_FDS = 4
_INLINE, _BLOB = b"I", b"B"


class ChannelClosed(EOFError):
    """The other end of a channel is gone (its process exited or closed it)."""


class Channel:
    """One end of a bidirectional message channel.

    Args:
        sock: a connected ``SOCK_SEQPACKET`` Unix socket.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @staticmethod
    def pair() -> tuple[Channel, Channel]:
        """Two connected ends (inheritable across ``fork``)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return Channel(a), Channel(b)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send a picklable message, and ``fds`` duplicated into the receiving process.

        Raises:
            ChannelClosed: if the other end is gone.
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        blob = -1
        if len(data) > _INLINE_LIMIT:
            blob = _memfd_with(data)
            data, fds = _BLOB + len(data).to_bytes(8, "little"), (*fds, blob)
        else:
            data = _INLINE + data
        try:
            socket.send_fds(self.sock, [data], list(fds)) if fds else self.sock.send(data)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from e
        finally:
            if blob >= 0:
                os.close(blob)

    def poll(self, timeout: float) -> bool:
        """Whether a message (or the end of the channel) can be read within ``timeout`` s."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return bool(ready)

    def recv(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors that came with it (the caller owns them).

        Raises:
            ChannelClosed: if the other end is gone.
        """
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, _RECV_BYTES, _MAX_FDS)
        except (ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from e
        if not data:
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("the other end closed the channel")
        if data[:1] == _BLOB:
            size = int.from_bytes(data[1:9], "little")
            blob = fds.pop()
            try:
                with mmap.mmap(blob, size, prot=mmap.PROT_READ) as view:
                    payload = view[:]
            finally:
                os.close(blob)
            return pickle.loads(payload), fds
        return pickle.loads(data[1:]), fds

    def close(self) -> None:
        self.sock.close()


def _memfd_with(data: bytes) -> int:
    fd = os.memfd_create("torchpipe-msg", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data)) as view:
            view[:] = data
    except BaseException:
        os.close(fd)
        raise
    return fd

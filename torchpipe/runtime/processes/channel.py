"""A message channel between two processes: pickled objects and file descriptors.

A ``Channel`` wraps one end of an ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair, which keeps message
boundaries and attaches passed file descriptors to the message they were sent with. Messages are
small control records (a sequence number, an offset, a length); a message too large for one
datagram travels in an anonymous memory file whose descriptor rides along instead, or, on a
channel told to pass no descriptors (:attr:`Channel.descriptors`), in chunks of one datagram each.

Every datagram starts with its kind and the number of descriptors sent with it, so a receiver
knows when some did not arrive: the kernel drops the descriptors it cannot install in a process
at its open-files limit (``RLIMIT_NOFILE``) and delivers the message without them
(``MSG_CTRUNC``). :meth:`Channel.recv` then raises :class:`DescriptorsLost` with the message, so
the caller can have what they held sent another way (``docs/process_pool.md``, "Open files").
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
import threading
import time
from typing import Any

_INLINE_LIMIT = 64 * 1024
_RECV_BYTES = _INLINE_LIMIT + 1024
_MAX_FDS = 4
_INLINE, _BLOB, _CHUNKED, _MORE = b"I", b"B", b"C", b"M"
_CHUNK_WAIT_S = 30.0  # the sender writes a chunked message's datagrams one after another


class ChannelClosed(EOFError):
    """The other end of a channel is gone (its process exited or closed it)."""


class DescriptorsLost(RuntimeError):
    """A message arrived without (some of) the file descriptors sent with it: the receiving
    process is at its open-files limit. Any that did arrive are closed.

    Attributes:
        message: the message itself, or None where its body rode in a descriptor that was lost.
    """

    def __init__(self, message: Any, sent: int, arrived: int) -> None:
        super().__init__(f"{arrived} of {sent} file descriptors arrived with a message")
        self.message = message


class Channel:
    """One end of a bidirectional message channel.

    Args:
        sock: a connected ``SOCK_SEQPACKET`` Unix socket.

    Attributes:
        descriptors: whether a large message may travel in a memory file's descriptor (True);
            False where the other process is short of descriptors: it goes in chunks instead.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.descriptors = True
        self._lock = threading.Lock()  # a chunked message's datagrams go out together

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
        try:
            with self._lock:
                if len(data) <= _INLINE_LIMIT:
                    self._send([_INLINE + bytes([len(fds)]), data], fds)
                elif self.descriptors:
                    self._send_blob(data, fds)
                else:
                    self._send_chunks(memoryview(data), fds)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from e

    def poll(self, timeout: float) -> bool:
        """Whether a message (or the end of the channel) can be read within ``timeout`` s."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return bool(ready)

    def recv(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors that came with it (the caller owns them).

        Raises:
            ChannelClosed: if the other end is gone.
            DescriptorsLost: the message came without the descriptors sent with it.
        """
        data, fds, truncated = self._recv_datagram()
        kind, sent, arrived = data[:1], data[1], len(fds)
        lost = truncated or arrived < sent
        try:
            if kind == _BLOB:
                payload = None if lost else _read_blob(data, fds)
            elif kind == _CHUNKED:
                payload = self._recv_chunks(data)
            else:
                payload = data[2:]
            message = pickle.loads(payload) if payload is not None else None
        except BaseException:
            _close_all(fds)
            raise
        if lost:
            _close_all(fds)
            raise DescriptorsLost(message, sent, arrived)
        return message, fds

    def close(self) -> None:
        self.sock.close()

    def _send(self, buffers: list[bytes | memoryview], fds: list[int] | tuple[int, ...]) -> None:
        if fds:
            socket.send_fds(self.sock, buffers, list(fds))
        else:
            self.sock.sendmsg(buffers)

    def _send_blob(self, data: bytes, fds: list[int] | tuple[int, ...]) -> None:
        blob = _memfd_with(data)
        try:
            header = _BLOB + bytes([len(fds) + 1]) + len(data).to_bytes(8, "little")
            self._send([header], (*fds, blob))
        finally:
            os.close(blob)

    def _send_chunks(self, data: memoryview, fds: list[int] | tuple[int, ...]) -> None:
        """A message of more than one datagram, with no descriptor of its own: its size and
        first chunk (with ``fds``), then the rest, one datagram each."""
        header = _CHUNKED + bytes([len(fds)]) + len(data).to_bytes(8, "little")
        self._send([header, data[:_INLINE_LIMIT]], fds)
        for start in range(_INLINE_LIMIT, len(data), _INLINE_LIMIT):
            self._send_within([_MORE, data[start : start + _INLINE_LIMIT]], _CHUNK_WAIT_S)

    def _send_within(self, buffers: list[bytes | memoryview], timeout: float) -> None:
        """Send a datagram, waiting at most ``timeout`` s for room: two processes that each send
        the other a chunked message while neither reads must not wait on each other for ever
        (the pool then treats the worker as gone, and its tasks go to a replacement)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.sendmsg(buffers, [], socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ChannelClosed(
                        f"no room to send to the other end in {timeout} s"
                    ) from None
                select.select([], [self.sock], [], min(remaining, 0.1))

    def _recv_datagram(self) -> tuple[bytes, list[int], bool]:
        try:
            data, fds, flags, _ = socket.recv_fds(self.sock, _RECV_BYTES, _MAX_FDS)
        except (ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from e
        if not data:
            _close_all(fds)
            raise ChannelClosed("the other end closed the channel")
        return data, fds, bool(flags & socket.MSG_CTRUNC)

    def _recv_chunks(self, first: bytes) -> bytes:
        size = int.from_bytes(first[2:10], "little")
        payload = bytearray(first[10:])
        while len(payload) < size:
            if not self.poll(_CHUNK_WAIT_S):
                raise ChannelClosed(f"a chunked message stopped at {len(payload)} of {size} bytes")
            data, fds, _ = self._recv_datagram()
            _close_all(fds)
            if data[:1] != _MORE:
                raise ChannelClosed(f"a chunked message stopped at {len(payload)} of {size} bytes")
            payload += data[1:]
        return bytes(payload)


def _read_blob(data: bytes, fds: list[int]) -> bytes:
    """A blob message's body, from its descriptor (the last sent), which it closes."""
    size = int.from_bytes(data[2:10], "little")
    blob = fds.pop()
    try:
        with mmap.mmap(blob, size, prot=mmap.PROT_READ) as view:
            return view[:]
    finally:
        os.close(blob)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


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

"""Single-producer/single-consumer byte rings in anonymous shared memory (Linux ``memfd``).

A worker process (the producer) writes each encoded result into its ring and sends only
``(offset, nbytes)`` to the main process (the consumer) over a socket; the consumer reads the
record in place, copies it out and releases it. A result larger than the ring goes into a
:class:`~torchpipe.runtime.processes.memfd.OneOffSegment` instead (memfd.py: the files both are made of).

A ring made with ``slot_bytes`` is a ring of fixed slots: every record takes one whole slot
(a record larger than a slot does not fit), so a ring of ``k`` slots always holds ``k`` records,
whatever their sizes; without it a record takes its own size and wraps as below.

Segments are anonymous files from ``os.memfd_create``, shared by passing the file descriptor
(``socket.send_fds`` or fork inheritance). Nothing is ever created in ``/dev/shm``: the memory
is freed when the last descriptor and mapping are gone, also after a crash or SIGKILL.

Layout of a ring segment (all integers native-endian uint64; ``C`` = capacity)::

    byte 0     +--------------------------------------------------+
               | magic "TPSHMRNG" | version | capacity C | 248 | S |  header (line 0)
    byte 64    +--------------------------------------------------+
               | head: bytes ever committed by the producer       |  written by producer only
    byte 128   +--------------------------------------------------+
               | tail: bytes ever released by the consumer        |  written by consumer only
    byte 192   +--------------------------------------------------+
               | unused                                           |
    byte 248   +--------------------------------------------------+
               | data area, C bytes (C is a multiple of the page) |
               |   record: [uint64 length][payload][pad to 64]    |
               |   wrap marker: [uint64 0xFFFF_FFFF_FFFF_FFFF]    |
    248 + C    +--------------------------------------------------+

``S`` is the slot size (0: records take their own size; else a multiple of the page that
divides ``C``, and every record takes ``S`` bytes). ``head`` and ``tail`` only grow; a byte
counter ``n`` lives at data offset ``n % C``. Records
start at data offsets that are multiples of 64, and the data area starts 8 bytes before a 64-byte
boundary: each length word ends a cache line and its payload starts on the next, so payloads (and
the tensors the codec lays out in them) are 64-byte aligned. When a record does not fit before
the end of the data area, the producer writes a wrap marker where it would have started and
puts the record at offset 0; the consumer's ``release`` skips the marker. An empty ring takes
any record that :meth:`ShmRing.fits`, wherever its cursors are; an empty ring of slots has its
producer move both cursors to slot 0 first, so slots a consumer that keeps up never needs stay
unwritten. See
``docs/shm_ring.md`` for the space rules and the memory-ordering argument.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import weakref

from torchpipe.runtime.processes.mapping import map_shared, mapping_address, resident_pages
from torchpipe.runtime.processes.memfd import (
    MAP_FLAGS,
    check_nbytes,
    map_memfd,
    new_memfd,
    unmap,
)

VERSION = 3
_MAGIC = b"TPSHMRNG"
_HEADER = struct.Struct("=8sQQQQ")  # magic, version, capacity, data offset, slot size
_LINE = 64
_LENGTH_BYTES = 8
# Three header lines, then the data area, shifted so that payloads (after their length word) are
# 64-byte aligned: CPU kernels may take a different path, and round differently, on unaligned data.
_DATA_START = 4 * _LINE - _LENGTH_BYTES
_HEAD_WORD = _LINE // 8
_TAIL_WORD = 2 * _LINE // 8
_DATA_WORD = _DATA_START // 8
_WRAP = 0xFFFF_FFFF_FFFF_FFFF
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3


def record_bytes(nbytes: int) -> int:
    """Bytes a record of ``nbytes`` payload takes in the data area: length word, payload, padding."""
    return -(-(_LENGTH_BYTES + nbytes) // _LINE) * _LINE


def _read_header(fd: int, mapping: bytes | mmap.mmap | memoryview, size: int) -> tuple[int, int]:
    """The capacity and slot size recorded in a ring's header, after checking the header
    describes this segment."""
    magic, version, capacity, start, slot = _HEADER.unpack_from(mapping, 0)
    if magic != _MAGIC:
        raise ValueError(f"fd {fd} is not a torchpipe shm ring: bad magic {magic!r}")
    if version != VERSION:
        raise ValueError(
            f"fd {fd}: shm ring version {version}, this torchpipe reads version {VERSION}"
        )
    if start != _DATA_START or capacity <= 0 or capacity % _LINE or start + capacity != size:
        raise ValueError(
            f"fd {fd}: corrupt shm ring header (capacity {capacity}, segment of {size} bytes)"
        )
    if slot and (slot % _LINE or capacity % slot):
        raise ValueError(
            f"fd {fd}: corrupt shm ring header (slots of {slot} bytes in a capacity of {capacity})"
        )
    return capacity, slot


def _page_multiple(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class Reservation:
    """Payload space handed out by :meth:`ShmRing.reserve`, published by :meth:`ShmRing.commit`.

    Attributes:
        buffer: writable memoryview of exactly ``nbytes`` bytes, starting on a 64-byte boundary;
            invalid after commit.
        offset: the record's offset in the data area (what the consumer gets).
        nbytes: payload size.
    """

    __slots__ = ("buffer", "offset", "nbytes", "_start")

    def __init__(self, buffer: memoryview, offset: int, nbytes: int, start: int) -> None:
        self.buffer = buffer
        self.offset = offset
        self.nbytes = nbytes
        self._start = start

    def __repr__(self) -> str:
        return f"Reservation(offset={self.offset}, nbytes={self.nbytes})"


class ShmRing:
    """A single-producer/single-consumer ring of variable-size records in one memfd segment.

    Make one with :meth:`create` (producer side, usually) and map it in the other process with
    :meth:`attach`. The producer calls :meth:`reserve`, fills the buffer, :meth:`commit` and
    sends the returned ``(offset, nbytes)``; the consumer calls :meth:`view` and then
    :meth:`release`, in commit order. Each side must be used by one thread at a time.
    """

    def __init__(
        self, fd: int, mapping: mmap.mmap | memoryview, capacity: int, slot_bytes: int = 0
    ) -> None:
        """Wrap a mapped, initialized segment; use :meth:`create` or :meth:`attach` instead."""
        self._fd = fd
        self._capacity = capacity
        self._slot = slot_bytes
        buf = memoryview(mapping)
        self._words = buf.cast("Q")
        self._data = buf[_DATA_START:]
        self._pending: Reservation | None = None
        self._closed = False
        self._mapping = mapping
        self._address = mapping_address(mapping) if fd < 0 else None  # for resident_bytes
        self._finalizer = weakref.finalize(self, unmap, fd, mapping, (self._words, self._data, buf))

    @classmethod
    def create(cls, capacity: int, slot_bytes: int = 0, first_slot: bool = True) -> ShmRing:
        """A new, empty ring with at least ``capacity`` bytes of data area.

        Args:
            capacity: rounded up to a multiple of the page (and of ``slot_bytes``).
            slot_bytes: 0 for records of their own size; else the size of the slot every record
                takes, a multiple of the page: a ring of ``capacity // slot_bytes`` slots.
            first_slot: a ring of slots allocates its first slot now (False: when first written,
                as the others).

        Raises:
            ValueError: ``capacity`` is not a positive int, or ``slot_bytes`` not a multiple of
                the page.
            OSError: memfd is unsupported, or the memory cannot be allocated.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"ring capacity must be a positive int, got {capacity!r}")
        if (
            isinstance(slot_bytes, bool)
            or not isinstance(slot_bytes, int)
            or slot_bytes < 0
            or slot_bytes % mmap.PAGESIZE
        ):
            raise ValueError(
                f"slot_bytes must be 0 or a multiple of the page ({mmap.PAGESIZE}), got {slot_bytes!r}"
            )
        capacity = (
            -(-capacity // slot_bytes) * slot_bytes if slot_bytes > 0 else _page_multiple(capacity)
        )
        # A ring of slots allocates and maps its first slot now, the others as they are first
        # written: slots a consumer that keeps up never needs take no memory (see _rewind_if_empty).
        size = _DATA_START + capacity
        first = slot_bytes if first_slot else 0
        fd = new_memfd("torchpipe-ring", size, _DATA_START + first if slot_bytes else size)
        try:
            mapping = map_memfd(fd, size, populate=not slot_bytes)
        except BaseException:
            os.close(fd)
            raise
        _HEADER.pack_into(mapping, 0, _MAGIC, VERSION, capacity, _DATA_START, slot_bytes)
        return cls(fd, mapping, capacity, slot_bytes)

    @classmethod
    def attach(cls, fd: int) -> ShmRing:
        """Map the ring behind ``fd`` (received from its creator) and close ``fd``: the mapping
        needs no descriptor, so a consumer holds none for the rings it reads (open-files limit).

        Raises:
            ValueError: ``fd`` is not a torchpipe ring of this version.
            OSError: ``fd`` is not an open file descriptor.
        """
        size = os.fstat(fd).st_size
        if size < _DATA_START:
            raise ValueError(
                f"fd {fd} is not a torchpipe shm ring: {size} bytes is less than a header"
            )
        header = os.pread(fd, _HEADER.size, 0)
        capacity, slot_bytes = _read_header(fd, header, size)
        # a ring of slots: its pages are mapped as records are read (populating would allocate
        # the slots not written yet)
        mapping = map_shared(fd, size, mmap.MAP_SHARED if slot_bytes else MAP_FLAGS)
        os.close(fd)
        return cls(-1, mapping, capacity, slot_bytes)

    @property
    def fd(self) -> int:
        """The memfd's descriptor, to send to the other process (it stays owned by this ring);
        -1 for an attached ring, which closed it."""
        return self._fd

    @property
    def capacity(self) -> int:
        """Bytes in the data area; each record takes its payload plus 8, rounded up to 64 (or a slot)."""
        return self._capacity

    @property
    def slot_bytes(self) -> int:
        """The bytes every record takes in a ring of slots; 0 where records take their own size."""
        return self._slot

    @property
    def slots(self) -> int | None:
        """How many records a ring of slots holds at once; None where records take their own size."""
        return self._capacity // self._slot if self._slot else None

    @property
    def closed(self) -> bool:
        return self._closed

    def bytes_in_use(self) -> int:
        """Bytes committed and not yet released (records, padding and skipped ends)."""
        self._check_open()
        return self._words[_HEAD_WORD] - self._words[_TAIL_WORD]

    def resident_bytes(self) -> int:
        """Bytes of the segment held in memory: its pages written and not given back (an attached
        ring, which holds no descriptor, asks ``mincore`` of its mapping: which of the memfd's
        pages are in memory, whether this process touched them or not)."""
        self._check_open()
        if self._fd >= 0:
            return os.fstat(self._fd).st_blocks * 512
        return resident_pages(self._address, len(self._mapping)) * mmap.PAGESIZE

    def give_back_free_slots(self, only: set[int] | None = None) -> int:
        """Give the pages of every slot that holds no record (of those at offsets ``only``, where
        given) back to the system, as a ring idle for a while does, or one under a memory budget
        once its records are released (a ring of slots only; the producer calls it, with no
        reservation outstanding). They read as zeros and are faulted in again when next written.
        A slot's first and last partial pages, shared with the header or a neighbour, stay.
        Returns the bytes given back."""
        self._check_open()
        if not self._slot or self._pending is not None or not hasattr(mmap, "MADV_REMOVE"):
            return 0
        mapping = self._mapping
        if not isinstance(mapping, mmap.mmap):
            raise ValueError("only the ring's creator gives back its slots' pages")
        given = 0
        for offset in self.free_slots() if only is None else self.free_slots() & only:
            start = _page_multiple(_DATA_START + offset)
            end = (_DATA_START + offset + self._slot) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                mapping.madvise(mmap.MADV_REMOVE, start, end - start)
                given += end - start
        return given

    def free_slots(self) -> set[int]:
        """The offsets of the slots that hold no record (a ring of slots)."""
        tail, head = self._words[_TAIL_WORD], self._words[_HEAD_WORD]
        held = {counter % self._capacity for counter in range(tail, head, self._slot)}
        return {offset for offset in range(0, self._capacity, self._slot) if offset not in held}

    def fits(self, nbytes: int) -> bool:
        """Whether a record of ``nbytes`` payload can ever be placed in this ring."""
        return nbytes >= 0 and record_bytes(nbytes) <= (self._slot or self._capacity)

    def reserve(self, nbytes: int, timeout: float) -> Reservation | None:
        """Contiguous space for a record of ``nbytes``, waiting up to ``timeout`` s for the consumer.

        Reserving again before committing abandons the previous reservation.

        Returns:
            The reservation, or None when the consumer freed too little space in time (check it
            is still alive and call again).

        Raises:
            ValueError: the record can never fit (see :meth:`fits`): use a OneOffSegment.
        """
        self._check_open()
        check_nbytes(nbytes)
        if not self.fits(nbytes):
            raise ValueError(
                f"a record of {nbytes} bytes needs {record_bytes(nbytes)} bytes, more than the ring's "
                f"{'slots of' if self._slot else 'capacity of'} {self._slot or self._capacity}: check fits() "
                "and use a OneOffSegment"
            )
        size = self._span(nbytes)
        self._pending = None
        self._rewind_if_empty()
        start = self._wait_for_space(size, timeout)
        if start is None:
            return None
        offset = start % self._capacity
        head = self._words[_HEAD_WORD]
        if start != head:
            self._words[_DATA_WORD + head % self._capacity // 8] = _WRAP
        buffer = self._data[offset + _LENGTH_BYTES : offset + _LENGTH_BYTES + nbytes]
        self._pending = Reservation(buffer, offset, nbytes, start)
        return self._pending

    def commit(self, reservation: Reservation) -> tuple[int, int]:
        """Publish a filled reservation; returns ``(offset, nbytes)`` to send to the consumer.

        Raises:
            ValueError: ``reservation`` is not this ring's outstanding one.
        """
        self._check_open()
        if reservation is not self._pending:
            raise ValueError(
                f"{reservation!r} is not the outstanding reservation (committed or dropped)"
            )
        self._pending = None
        start, nbytes = reservation._start, reservation.nbytes
        self._words[_DATA_WORD + reservation.offset // 8] = nbytes
        # The payload, length word and any wrap marker are all stored before head moves.
        self._words[_HEAD_WORD] = start + self._span(nbytes)
        try:
            reservation.buffer.release()  # so a late write fails instead of corrupting the ring
        except BufferError:
            pass
        return reservation.offset, nbytes

    def view(self, offset: int, nbytes: int, writable: bool = False) -> memoryview:
        """Access to the committed record ``(offset, nbytes)`` (64-byte aligned), valid until its release.

        Args:
            writable: hand out a writable view (the consumer owns the record until it releases
                it; the producer never touches it before).

        Raises:
            ValueError: there is no record of ``nbytes`` at ``offset``.
        """
        self._check_open()
        self._check_bounds(offset, nbytes)
        self._check_length(offset, nbytes)
        start = offset + _LENGTH_BYTES
        view = self._data[start : start + nbytes]
        return view if writable else view.toreadonly()

    def release(self, offset: int, nbytes: int) -> None:
        """Free the oldest record, ``(offset, nbytes)``, so the producer can reuse its space.

        Raises:
            ValueError: it is not the oldest unreleased record, or nothing is committed.
        """
        self._check_open()
        self._check_bounds(offset, nbytes)
        tail, head = self._words[_TAIL_WORD], self._words[_HEAD_WORD]
        start = self._oldest_start(tail, head, offset, nbytes)
        self._check_length(offset, nbytes)
        # The caller has finished reading the payload before this store lets the producer in.
        self._words[_TAIL_WORD] = start + self._span(nbytes)

    def close(self) -> None:
        """Unmap and close the descriptor; idempotent. The other process's mapping stays valid."""
        self._closed = True
        self._pending = None
        self._finalizer()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        slots = f", slots of {self._slot}" if self._slot else ""
        return f"ShmRing(capacity={self._capacity}{slots}, {state})"

    def _span(self, nbytes: int) -> int:
        """Bytes a record of ``nbytes`` payload takes in this ring: its own size, or one slot."""
        return self._slot or record_bytes(nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("shm ring is closed")

    def _rewind_if_empty(self) -> None:
        """An empty ring of slots starts again at slot 0: its producer moves both cursors there
        (the consumer, with no record to release, does not touch its tail until the next record
        is sent). Where the consumer keeps up, every record then goes to slot 0 and the other
        slots stay unwritten, so they can give their pages back (docs/shm_ring.md)."""
        if not self._slot:
            return
        head = self._words[_HEAD_WORD]
        position = head % self._capacity
        if position and self._words[_TAIL_WORD] == head:
            start = head - position + self._capacity
            self._words[_TAIL_WORD] = start
            self._words[_HEAD_WORD] = start

    def _wait_for_space(self, size: int, timeout: float) -> int | None:
        """Where the record will start, polling the consumer's tail with growing sleeps."""
        deadline = time.monotonic() + max(0.0, timeout)
        sleep = _FIRST_SLEEP_S
        while True:
            start = self._placement(size)
            if start is not None:
                return start
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(sleep, remaining))
            sleep = min(2 * sleep, _MAX_SLEEP_S)

    def _placement(self, size: int) -> int | None:
        """The byte counter a record of ``size`` would start at, or None if it is not free yet."""
        head, tail = self._words[_HEAD_WORD], self._words[_TAIL_WORD]
        position = head % self._capacity
        if position + size <= self._capacity:
            return head if head + size <= tail + self._capacity else None
        start = head - position + self._capacity
        # An empty ring is free everywhere, even where the wrap marker sits (docs/shm_ring.md).
        return start if tail == head or start + size <= tail + self._capacity else None

    def _check_bounds(self, offset: int, nbytes: int) -> None:
        check_nbytes(nbytes)
        aligned = isinstance(offset, int) and offset >= 0 and offset % _LINE == 0
        if not aligned or offset + self._span(nbytes) > self._capacity:
            raise ValueError(
                f"no record of {nbytes} bytes can start at offset {offset!r} of this ring"
            )

    def _check_length(self, offset: int, nbytes: int) -> None:
        length = self._words[_DATA_WORD + offset // 8]
        if length == _WRAP:
            raise ValueError(f"offset {offset} holds a wrap marker, not a record")
        if length != nbytes:
            raise ValueError(f"the record at offset {offset} holds {length} bytes, not {nbytes}")

    def _oldest_start(self, tail: int, head: int, offset: int, nbytes: int) -> int:
        """The byte counter of the oldest record, checking it is ``(offset, nbytes)``."""
        if tail >= head:
            raise ValueError(f"release({offset}, {nbytes}): nothing is committed and unreleased")
        position = tail % self._capacity
        marker = self._words[_DATA_WORD + position // 8] == _WRAP
        if offset == position and not marker:
            start = tail
        elif offset == 0 and position and (marker or self._span(nbytes) > position):
            # A wrapped record larger than ``position`` was placed in an empty ring and overwrote
            # the marker; a record behind a real one at ``position`` is never that large.
            start = tail - position + self._capacity
        else:
            oldest = 0 if marker else position
            raise ValueError(
                f"release(offset={offset}, nbytes={nbytes}): records must be released in the order they "
                f"were committed; the oldest unreleased record is at offset {oldest}"
            )
        if start + self._span(nbytes) > head:
            raise ValueError(
                f"release(offset={offset}, nbytes={nbytes}): that record is not committed"
            )
        return start

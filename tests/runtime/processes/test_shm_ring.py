import collections
import mmap
import multiprocessing
import os
import random
import signal
import socket
import struct

import numpy as np
import pytest

from tests.processes import dev_shm
from torchpipe.runtime.processes.memfd import OneOffSegment, memfd_supported
from torchpipe.runtime.processes.shm_ring import VERSION, ShmRing

pytestmark = pytest.mark.skipif(not memfd_supported(), reason="needs Linux memfd_create")

PAGE = mmap.PAGESIZE
MESSAGE = struct.Struct("=qq")  # (offset, nbytes); offset -1 means "the producer timed out"
FORK = multiprocessing.get_context("fork")


@pytest.fixture(autouse=True)
def nothing_in_dev_shm():
    before = dev_shm()
    yield
    assert dev_shm() == before


def payload(rng, nbytes):
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def put(ring, data, timeout=0.0):
    reservation = ring.reserve(len(data), timeout)
    assert reservation is not None and len(reservation.buffer) == len(data)
    reservation.buffer[:] = data
    return ring.commit(reservation)


def take(ring, offset, nbytes):
    data = bytes(ring.view(offset, nbytes))
    ring.release(offset, nbytes)
    return data


def address(buffer):
    return np.frombuffer(buffer, np.uint8).ctypes.data


# ---- single process ---------------------------------------------------------------------------


def test_capacity_is_rounded_up_to_pages_and_fd_is_an_anonymous_memfd():
    with ShmRing.create(1) as ring:
        assert ring.capacity == PAGE
        assert os.readlink(f"/proc/self/fd/{ring.fd}").startswith("/memfd:torchpipe-ring")
    with ShmRing.create(PAGE + 1) as ring:
        assert ring.capacity == 2 * PAGE
    for bad in (0, -5, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="capacity"):
            ShmRing.create(bad)


def test_round_trip_and_record_framing():
    with ShmRing.create(PAGE) as ring:
        assert put(ring, b"hello") == (0, 5)
        assert put(ring, b"") == (64, 0)  # records start on 64-byte lines: 8 + 5 bytes -> 64
        assert put(ring, bytes(100)) == (128, 100)
        assert ring.bytes_in_use() == 64 + 64 + 128
        view = ring.view(0, 5)
        assert view.readonly and bytes(view) == b"hello"
        lent = ring.view(0, 5, writable=True)  # the consumer owns the record until its release
        lent[0:1] = b"j"
        assert bytes(view) == b"jello"
        assert take(ring, 0, 5) == b"jello"
        assert take(ring, 64, 0) == b""
        assert take(ring, 128, 100) == bytes(100)
        assert ring.bytes_in_use() == 0


def test_payloads_start_on_64_byte_boundaries_in_both_mappings_also_after_wrapping():
    rng = np.random.default_rng(11)
    sizes = [0, 1, 7, 55, 56, 57, 63, 64, 65, 1000, 3001, 2 * PAGE - 8]
    pending = collections.deque()
    wraps = last = 0
    with ShmRing.create(2 * PAGE) as ring, ShmRing.attach(os.dup(ring.fd)) as other:
        for _ in range(400):
            data = payload(rng, int(rng.choice(sizes)))
            reservation = ring.reserve(len(data), timeout=0)
            while reservation is None:  # full: the consumer frees the oldest record
                record, expected = pending.popleft()
                assert take(other, *record) == expected
                reservation = ring.reserve(len(data), timeout=0)
            assert address(reservation.buffer) % 64 == 0
            reservation.buffer[:] = data
            offset, nbytes = ring.commit(reservation)
            wraps += offset < last
            last = offset
            for side in (ring, other):
                assert address(side.view(offset, nbytes)) % 64 == 0
                assert address(side.view(offset, nbytes, writable=True)) % 64 == 0
            pending.append(((offset, nbytes), data))
        assert wraps > 20
    for nbytes in (0, 1, 3 * PAGE + 5):
        with (
            OneOffSegment.create(nbytes) as segment,
            OneOffSegment.attach(os.dup(segment.fd), nbytes) as other,
        ):
            assert address(segment.buffer) % 64 == 0 and address(other.buffer) % 64 == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_sizes_wrap_around_many_times(seed):
    rng = np.random.default_rng(seed)
    pending = collections.deque()
    wraps = last = 0
    with ShmRing.create(2 * PAGE) as ring:
        for _ in range(3000):
            if pending and rng.random() < 0.5:
                offset, data = pending.popleft()
                assert take(ring, offset, len(data)) == data
                continue
            data = payload(rng, int(rng.integers(0, rng.choice([100, 1000, ring.capacity - 8]))))
            reservation = ring.reserve(len(data), timeout=0)
            if reservation is None:
                assert pending, "an empty ring must take any record that fits"
                continue
            reservation.buffer[:] = data
            offset, _ = ring.commit(reservation)
            wraps += offset < last
            last = offset
            pending.append((offset, data))
        while pending:
            offset, data = pending.popleft()
            assert take(ring, offset, len(data)) == data
        assert ring.bytes_in_use() == 0
    assert wraps > 100


def test_empty_ring_takes_a_full_size_record_wherever_its_cursors_are():
    with ShmRing.create(PAGE) as ring:
        for skip, fill in [(64, 0), (64, 0xFF), (1024, 7), (1024, 0xFF), (PAGE - 64, 0)]:
            take(ring, *put(ring, bytes(skip - 8)))  # moves the cursors along, away from 0
            # overwrites the wrap marker (0xFF: with a look-alike)
            whole = bytes([fill]) * (PAGE - 8)
            assert put(ring, whole) == (0, PAGE - 8)
            assert take(ring, 0, PAGE - 8) == whole
            assert put(ring, b"after") == (0, 5)
            assert take(ring, 0, 5) == b"after"


def test_full_ring_times_out_and_release_frees_space():
    with ShmRing.create(PAGE) as ring:
        records = [put(ring, bytes([i]) * 1000) for i in range(4)]  # 4 x 1024 bytes: full
        assert ring.reserve(1, timeout=0) is None
        assert ring.reserve(1, timeout=0.02) is None
        assert take(ring, *records[0]) == bytes([0]) * 1000
        assert ring.reserve(2000, timeout=0) is None  # 1024 free bytes are not enough
        assert put(ring, b"x" * 1000) == (0, 1000)


def test_release_out_of_order_is_refused():
    with ShmRing.create(PAGE) as ring:
        with pytest.raises(ValueError, match="nothing is committed"):
            ring.release(0, 0)
        first, second = put(ring, b"a" * 10), put(ring, b"b" * 10)
        with pytest.raises(ValueError, match="order.*oldest unreleased record is at offset 0"):
            ring.release(*second)
        with pytest.raises(ValueError, match="holds 10 bytes, not 11"):
            ring.release(0, 11)
        with pytest.raises(ValueError, match="no record"):
            ring.release(3, 10)
        assert take(ring, *first) == b"a" * 10
        assert take(ring, *second) == b"b" * 10


def test_release_out_of_order_across_a_wrap_is_refused():
    with ShmRing.create(PAGE) as ring:
        x = put(ring, bytes(2000))  # [0, 2048)
        a = put(ring, b"a" * 1000)  # [2048, 3072)
        take(ring, *x)
        b = put(ring, b"b" * 1500)  # 1536 bytes do not fit before the end: wraps to 0
        assert (a[0], b[0]) == (2048, 0)
        with pytest.raises(ValueError, match="oldest unreleased record is at offset 2048"):
            ring.release(*b)
        assert take(ring, *a) == b"a" * 1000
        with pytest.raises(ValueError, match="wrap marker"):
            ring.view(3072, 0)
        assert take(ring, *b) == b"b" * 1500


def test_fits_and_too_large_records():
    with ShmRing.create(PAGE) as ring:
        assert ring.fits(0) and ring.fits(PAGE - 8)
        assert not ring.fits(PAGE - 7) and not ring.fits(-1)
        with pytest.raises(ValueError, match="OneOffSegment"):
            ring.reserve(PAGE - 7, timeout=30)
        with pytest.raises(ValueError, match="nbytes"):
            ring.reserve(-1, timeout=0)


@pytest.mark.parametrize("seed", range(3))
def test_a_ring_of_slots_holds_exactly_its_slots_whatever_the_record_sizes(seed):
    rng = np.random.default_rng(seed)
    with (
        ShmRing.create(3 * PAGE, slot_bytes=PAGE) as ring,
        ShmRing.attach(os.dup(ring.fd)) as other,
    ):
        assert (ring.capacity, ring.slot_bytes, ring.slots) == (3 * PAGE, PAGE, 3)
        assert (other.slot_bytes, other.slots) == (PAGE, 3)  # read from the header
        # a record larger than a slot never fits
        assert ring.fits(PAGE - 8) and not ring.fits(PAGE - 7)
        held = collections.deque()
        # sizes that would leave a byte ring unable to place a slot-sized record
        for _ in range(60):
            while len(held) < 3:
                data = payload(rng, int(rng.integers(0, PAGE - 7)))
                offset, nbytes = put(ring, data)
                assert offset % PAGE == 0
                held.append((offset, nbytes, data))
            assert ring.reserve(0, timeout=0) is None  # every slot is held
            for _ in range(int(rng.integers(1, 4))):
                offset, nbytes, data = held.popleft()
                assert take(other, offset, nbytes) == data
        assert ring.bytes_in_use() == len(held) * PAGE


def test_slots_must_be_pages():
    for bad in (100, -PAGE, True):
        with pytest.raises(ValueError, match="slot_bytes"):
            ShmRing.create(PAGE, slot_bytes=bad)
    with ShmRing.create(PAGE + 1, slot_bytes=2 * PAGE) as ring:
        assert ring.capacity == 2 * PAGE and ring.slots == 1  # rounded up to whole slots
    with ShmRing.create(PAGE) as ring:
        assert ring.slot_bytes == 0 and ring.slots is None


def test_commit_only_the_outstanding_reservation():
    with ShmRing.create(PAGE) as ring:
        stale = ring.reserve(10, timeout=0)
        fresh = ring.reserve(20, timeout=0)  # abandons `stale`
        with pytest.raises(ValueError, match="not the outstanding"):
            ring.commit(stale)
        fresh.buffer[:] = b"z" * 20
        assert ring.commit(fresh) == (0, 20)
        with pytest.raises(ValueError, match="not the outstanding"):
            ring.commit(fresh)
        with pytest.raises(ValueError):
            fresh.buffer[0] = 1  # released at commit: late writes cannot corrupt the ring
        assert take(ring, 0, 20) == b"z" * 20


def test_attach_validates_the_header():
    with ShmRing.create(PAGE) as ring, ShmRing.attach(os.dup(ring.fd)) as other:
        assert other.capacity == ring.capacity
        assert put(ring, b"shared") == (0, 6)
        assert bytes(other.view(0, 6)) == b"shared"
    cases = {
        b"\0" * 64: "less than a header",
        b"NOTARING" + bytes(PAGE): "bad magic",
        struct.pack("=8sQQQ", b"TPSHMRNG", VERSION + 1, PAGE, 248) + bytes(PAGE + 216): "version",
        struct.pack("=8sQQQ", b"TPSHMRNG", VERSION, 2 * PAGE, 248) + bytes(PAGE + 216): "corrupt",
        struct.pack("=8sQQQ", b"TPSHMRNG", VERSION, PAGE, 192) + bytes(PAGE + 216): "corrupt",
        struct.pack("=8sQQQQ", b"TPSHMRNG", VERSION, 2 * PAGE, 248, 3 * PAGE)
        + bytes(2 * PAGE + 208): "slots of",
    }
    for content, message in cases.items():
        fd = os.memfd_create("not-a-ring")
        os.write(fd, content)
        try:
            with pytest.raises(ValueError, match=message):
                ShmRing.attach(fd)
        finally:
            os.close(fd)
    with pytest.raises(OSError):
        ShmRing.attach(10_000)


def test_segments_are_sealed_against_resizing():
    with ShmRing.create(PAGE) as ring, OneOffSegment.create(100) as segment:
        for fd in (ring.fd, segment.fd):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)


def test_close_is_idempotent_and_leaves_other_mappings_and_held_views_valid():
    producer = ShmRing.create(PAGE)
    consumer = ShmRing.attach(os.dup(producer.fd))
    put(producer, b"survives")
    producer.close()
    producer.close()
    assert producer.closed
    with pytest.raises(ValueError, match="closed"):
        producer.reserve(1, timeout=0)
    held = consumer.view(0, 8)
    consumer.close()
    consumer.close()
    assert bytes(held) == b"survives"  # the mapping lives as long as a view of it
    with pytest.raises(ValueError, match="closed"):
        consumer.view(0, 8)
    segment = OneOffSegment.create(10)
    segment.close()
    segment.close()


def test_one_off_segment_any_size():
    for nbytes in (0, 1, 3 * PAGE + 5):
        with OneOffSegment.create(nbytes) as segment:
            assert len(segment.buffer) == nbytes == segment.nbytes
            segment.buffer[:] = b"q" * nbytes
            with OneOffSegment.attach(os.dup(segment.fd), nbytes) as other:
                assert bytes(other.buffer) == b"q" * nbytes
    with OneOffSegment.create(10) as segment, pytest.raises(ValueError, match="cannot hold"):
        OneOffSegment.attach(segment.fd, 11)
    with pytest.raises(ValueError, match="nbytes"):
        OneOffSegment.create(-1)


# ---- two processes ----------------------------------------------------------------------------


def send(sock, offset, nbytes):
    sock.sendall(MESSAGE.pack(offset, nbytes))


def recv(sock):
    data = b""
    while len(data) < MESSAGE.size:
        chunk = sock.recv(MESSAGE.size - len(data))
        if not chunk:
            raise EOFError("producer closed the socket")
        data += chunk
    return MESSAGE.unpack(data)


def records(seed, count, max_nbytes):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield payload(rng, int(rng.integers(0, max_nbytes)))


def produce(ring, sock, data, report_timeouts=False):
    """Reserve with short timeouts (reporting the first one), fill, commit, send (offset, nbytes)."""
    timeouts = 0
    reservation = ring.reserve(len(data), timeout=0.05)
    while reservation is None:
        timeouts += 1
        if report_timeouts and timeouts == 1:
            send(sock, -1, 0)
        reservation = ring.reserve(len(data), timeout=0.5)
    reservation.buffer[:] = data
    send(sock, *ring.commit(reservation))
    return timeouts


def producer_with_inherited_fd(fd, sock, seed, count):
    ring = ShmRing.attach(os.dup(fd))
    for data in records(seed, count, 3000):
        produce(ring, sock, data)
    ring.close()


def producer_sending_its_fd(sock, seed, count):
    ring = ShmRing.create(PAGE)
    socket.send_fds(sock, [b"R"], [ring.fd])
    for i in range(4):  # 4 records of 1024 bytes fill the ring
        assert produce(ring, sock, bytes([i]) * 1000) == 0
    assert produce(ring, sock, b"blocked", report_timeouts=True) > 0
    for data in records(seed, count, 1000):
        produce(ring, sock, data)
    ring.close()


def producer_forever(fd, sock):
    ring = ShmRing.attach(os.dup(fd))
    for i in range(10**9):
        produce(ring, sock, i.to_bytes(8, "little") * 10)  # 128-byte records: 32 fit


def start(target, *args):
    process = FORK.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def finish(process, expect=0):
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join(5)
    assert process.exitcode == expect


def consume(ring, sock, expected):
    for data in expected:
        offset, nbytes = recv(sock)
        assert nbytes == len(data) and bytes(ring.view(offset, nbytes)) == data
        ring.release(offset, nbytes)


def test_two_processes_inherited_fd():
    parent, child = socket.socketpair()
    parent.settimeout(20)
    with ShmRing.create(2 * PAGE) as ring, parent, child:
        process = start(producer_with_inherited_fd, ring.fd, child, 7, 400)
        consume(ring, parent, records(7, 400, 3000))
        finish(process)
        assert ring.bytes_in_use() == 0


def test_two_processes_fd_passing_and_producer_blocks_until_released():
    parent, child = socket.socketpair()
    parent.settimeout(20)
    with parent, child:
        process = start(producer_sending_its_fd, child, 3, 300)
        _, fds, _, _ = socket.recv_fds(parent, 1, 1)
        with ShmRing.attach(fds[0]) as ring:
            held = [recv(parent) for _ in range(4)]
            assert recv(parent) == (-1, 0)  # the producer's reserve timed out: the ring is full
            for i, (offset, nbytes) in enumerate(held):
                assert bytes(ring.view(offset, nbytes)) == bytes([i]) * 1000
                ring.release(offset, nbytes)
            consume(ring, parent, [b"blocked", *records(3, 300, 1000)])
        finish(process)


def test_one_off_segment_outlives_the_process_that_made_it():
    parent, child = socket.socketpair()
    parent.settimeout(20)
    nbytes = 5 * 2**20 + 3
    expected = payload(np.random.default_rng(1), nbytes)

    def make_segment():
        with OneOffSegment.create(nbytes) as segment:
            segment.buffer[:] = expected
            socket.send_fds(child, [b"S"], [segment.fd])

    with parent, child:
        finish(start(make_segment))
        _, fds, _, _ = socket.recv_fds(parent, 1, 1)
        with OneOffSegment.attach(fds[0], nbytes) as segment:
            assert bytes(segment.buffer) == expected


def test_sigkill_mid_stream_leaves_nothing_behind():
    parent, child = socket.socketpair()
    parent.settimeout(20)
    with ShmRing.create(PAGE) as ring, parent, child:
        process = start(producer_forever, ring.fd, child)
        held = []
        for i in range(60):
            offset, nbytes = recv(parent)
            assert bytes(ring.view(offset, nbytes)) == i.to_bytes(8, "little") * 10
            if i < 40:
                ring.release(offset, nbytes)
            else:
                held.append((i, offset, nbytes))
        os.kill(process.pid, signal.SIGKILL)
        finish(process, expect=-signal.SIGKILL)
        for i, offset, nbytes in held:  # committed before the kill: still readable here
            assert bytes(ring.view(offset, nbytes)) == i.to_bytes(8, "little") * 10
            ring.release(offset, nbytes)


def test_boundary_sizes():
    rng = random.Random(5)
    with ShmRing.create(PAGE) as ring:
        pending = collections.deque()
        for _ in range(2000):
            nbytes = rng.choice([0, 1, 56, 57, 1000, 2040, 2041, PAGE - 72, PAGE - 8])
            reservation = ring.reserve(nbytes, timeout=0)
            if reservation is None:
                offset, data = pending.popleft()
                assert take(ring, offset, len(data)) == data
                continue
            data = rng.randbytes(nbytes)
            reservation.buffer[:] = data
            pending.append((ring.commit(reservation)[0], data))
        for offset, data in pending:
            assert take(ring, offset, len(data)) == data


def test_free_slots_give_their_pages_back_and_the_held_ones_keep_their_records():
    slot = 64 * PAGE
    with ShmRing.create(3 * slot, slot) as ring:
        other = ShmRing.attach(os.dup(ring.fd))  # the consumer's mapping
        placed = []
        for value in (1, 2):
            reservation = ring.reserve(slot - 64, timeout=0)
            reservation.buffer[:] = bytes([value]) * (slot - 64)
            placed.append(ring.commit(reservation))
        other.release(*placed[0])  # the first slot is free again, the second still held
        # the two slots written hold their pages; the third, never written, holds none
        assert 2 * slot <= ring.resident_bytes() < 3 * slot
        given = ring.give_back_free_slots()
        assert given >= 2 * slot - 4 * PAGE  # two slots, less the partial pages they share
        assert ring.resident_bytes() <= slot + 4 * PAGE
        # the held record is intact
        assert bytes(other.view(*placed[1])) == bytes([2]) * (slot - 64)
        reservation = ring.reserve(slot - 64, timeout=0)  # a free slot is written again: faulted in
        reservation.buffer[:] = bytes([3]) * (slot - 64)
        assert bytes(other.view(*ring.commit(reservation))) == bytes([3]) * (slot - 64)
        other.close()
    with ShmRing.create(4 * PAGE) as plain:
        # records of their own sizes: no slots to give back
        assert plain.give_back_free_slots() == 0


def test_an_empty_ring_of_slots_starts_again_at_its_first_slot():
    """A consumer that keeps up empties the ring before each record: the records all go to slot
    0, so the other slots stay unwritten (and can give their pages back); a consumer that falls
    behind gets every slot, in order, right after such a restart."""
    rng = np.random.default_rng(0)
    with (
        ShmRing.create(3 * PAGE, slot_bytes=PAGE) as ring,
        ShmRing.attach(os.dup(ring.fd)) as other,
    ):
        data = payload(rng, 100)
        first = put(ring, data)
        second = put(ring, data)
        assert (first[0], second[0]) == (0, PAGE)
        take(other, *first)
        take(other, *second)  # empty, its cursors at slot 2: the next record goes to slot 0
        for _ in range(5):  # kept up with: slot 0 each time
            offset, nbytes = put(ring, data)
            assert offset == 0
            assert take(other, offset, nbytes) == data
        assert ring.free_slots() == {0, PAGE, 2 * PAGE}
        # then a consumer falling behind
        datas = [payload(rng, 50 + k) for k in range(3)]
        held = [put(ring, data) for data in datas]
        assert [offset for offset, _ in held] == [0, PAGE, 2 * PAGE]  # every slot, in order
        assert ring.reserve(0, timeout=0) is None
        with pytest.raises(ValueError, match="order they were committed"):
            other.release(*held[1])
        assert [take(other, *placed) for placed in held] == datas
        assert ring.bytes_in_use() == 0 and ring.free_slots() == {0, PAGE, 2 * PAGE}

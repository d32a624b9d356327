"""RingLoans: ring records lent out as decoded arrays, returned in order once their views die."""

import gc
import sys
import threading

import numpy as np
import pytest

from torchpipe.runtime.processes.loans import RingLoans
from torchpipe.runtime.processes.memfd import memfd_supported
from torchpipe.runtime.processes.shm_ring import ShmRing

pytestmark = pytest.mark.skipif(not memfd_supported(), reason="needs Linux memfd_create")


def _commit(ring, data):
    reservation = ring.reserve(len(data), 0.0)
    reservation.buffer[:] = data
    return ring.commit(reservation)


@pytest.fixture
def loans():
    ring = ShmRing.create(1 << 16)
    loans = RingLoans(ring)
    yield loans
    loans.close()


def test_a_lent_record_is_a_writable_array_of_its_bytes_returned_when_freed(loans):
    offset, nbytes = _commit(loans.ring, b"abcdef")
    array = loans.lend(offset, nbytes)
    assert array.dtype == np.uint8 and array.tobytes() == b"abcdef"
    array[0] = ord("z")  # the consumer owns the record until it is returned
    assert bytes(loans.ring.view(offset, nbytes)) == b"zbcdef"
    assert loans.ring.bytes_in_use() > 0
    del array
    gc.collect()
    assert loans.ring.bytes_in_use() == 0


def test_a_view_of_the_array_keeps_the_record_lent(loans):
    array = loans.lend(*_commit(loans.ring, b"0123456789"))
    tail = array[4:]
    del array
    gc.collect()
    assert loans.ring.bytes_in_use() > 0 and tail.tobytes() == b"456789"
    del tail
    gc.collect()
    assert loans.ring.bytes_in_use() == 0


def test_a_record_freed_early_waits_for_the_older_ones(loans):
    first = loans.lend(*_commit(loans.ring, b"first"))
    second = loans.lend(*_commit(loans.ring, b"second"))
    in_use = loans.ring.bytes_in_use()
    del second  # the ring wants the first back before it
    gc.collect()
    assert loans.ring.bytes_in_use() == in_use
    del first
    gc.collect()
    assert loans.ring.bytes_in_use() == 0


def test_a_record_freed_on_another_thread_is_returned(loans):
    held = [loans.lend(*_commit(loans.ring, b"x" * 100))]
    thread = threading.Thread(target=held.clear)
    thread.start()
    thread.join(timeout=10)
    gc.collect()
    assert not thread.is_alive() and loans.ring.bytes_in_use() == 0


def test_a_record_freed_after_the_ring_closed_is_not_released(monkeypatch):
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    loans = RingLoans(ShmRing.create(1 << 16))
    array = loans.lend(*_commit(loans.ring, b"late"))
    loans.close()
    assert loans.ring.closed
    del array  # releasing on a closed ring would raise in the finalizer
    gc.collect()
    assert raised == []

"""Where a worker's results go: its ring of slots, or a one-off segment.

A worker's ring holds exactly the results the main process may hold from it at once: the tasks
it may have in flight and undelivered, plus the one the consumer holds (none where each result is
copied out as it arrives). The pool tells the worker that count (``("slots", n)``). The worker's
first result sizes the ring: ``n`` slots of :func:`slot_bytes` each, the last of them (where
``n`` is 2 or more) a ring of its own, the spare, written only where a result finds the others
all held: a ring turns through all its slots while it never empties, so a consumer that holds
one result while the next comes kept every slot resident with two in use. A result larger than a slot,
or one that finds every slot still held, goes to a one-off segment, freed when the main process is
done with it, as torch's DataLoader frees each batch (where most results outgrow the slots, the
first result was not typical: a ring of as many, larger slots replaces it; where a consumer
steadily holds more results than it said, a prefetch buffer above a map say, a ring with a slot
more replaces it, up to :data:`HELD_MORE` more). The slots keep their pages (written once, reused
by every result after), so large results pay no page faults, until the worker has been idle for
:data:`IDLE_S` (an epoch ended, an evaluation runs): then the slots that hold no result give their
pages back, as torch's DataLoader holds no batch between epochs. A slot unwritten for as long
gives its pages back too: an empty ring starts again at its first slot (``ShmRing``), so where
the consumer keeps up with the worker its results all go to the first slots and the others go
cold; the ring then holds what is in flight, as torch's DataLoader does, not every slot it has.
"""

from __future__ import annotations

import collections
import mmap
import pickle
import threading
import time
import traceback
from typing import Any

from torchpipe.runtime import codec
from torchpipe.runtime.counts import COUNTS, Tally
from torchpipe.runtime.processes.channel import Channel, ChannelClosed
from torchpipe.runtime.processes.memfd import OneOffSegment
from torchpipe.runtime.processes.shm_ring import Reservation, ShmRing, record_bytes
from torchpipe.runtime.timing import CallClock

Cost = tuple[float, float, float, float, Tally | None]
"""What a task cost, sent with its result: see :func:`_cost`."""

SLOT_HEADROOM = 16
"""A slot holds its first result plus 1/16th (at most :data:`MAX_HEADROOM_BYTES`; rounded up to
the page): a later result of the same kind that is a little larger (a longer caption, a larger
pickle) still fits."""
MAX_HEADROOM_BYTES = 1 << 20
"""A large result's headroom: batches of tens of MB are mostly tensors of one shape, whose size
does not vary; a slot of each is held in two processes' memory."""
MAX_RING_BYTES = 512 << 20
"""A worker's rings together hold at most this; results beyond go to one-off segments."""
IDLE_S = 1.0
"""A worker that has received no task and written no result for this long gives back the pages of
its free slots (:meth:`Output.give_back_idle`); its next results fault them in again (38 MB: ~10 ms)."""
RING_GRACE_S = 0.002
"""A slot freed this soon is worth waiting for rather than making a one-off segment."""
_RESIZE_AFTER, _SIZE_WINDOW = (
    8,
    16,
)  # of the last 16 results, 8 too large for a slot re-size the ring
HELD_MORE = 4
"""The most slots a worker's ring adds, one at a time, for results its consumer holds beyond what
it said: a prefetch buffer above a map, a batch kept for a log. A one-off segment costs a result
its pages' faults and a copy more (38 MB batches: 2 GB/s against 8 through slots), so where
:data:`_HELD_AFTER` of the last 16 results found every slot held, the next one sizes a ring with
a slot more. Beyond these, results the consumer keeps go to one-off segments, freed as it lets go."""
_HELD_AFTER = 4
_CLOSE_S = 2.0


def slot_bytes(nbytes: int) -> int:
    """The slot a ring sized at a first result of ``nbytes`` gives every record: the record with
    its headroom (:data:`SLOT_HEADROOM`), rounded up to the page."""
    size = record_bytes(nbytes + min(nbytes // SLOT_HEADROOM, MAX_HEADROOM_BYTES))
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


class Output:
    """Runs a worker's tasks' results out: into its ring of slots, or a one-off segment.

    One ring of ``slots`` slots, sized at the first result after the slot count was set; a
    result that does not fit a slot, or finds none free within :data:`RING_GRACE_S`, takes a
    one-off segment. A new slot count takes effect with a new ring at the next result (the old
    one is let go once its records are back): the autotuner changed how many results are held.
    So does a first result that was not typical: where half the last 16 results were too large
    for a slot, the next one sizes a new ring (of as many slots; it replaces the old one). And a
    consumer that steadily holds more results than it said gets a slot more, up to
    :data:`HELD_MORE`.

    Safe to call from several threads: one lock is held from reserving room to sending the
    message (the main process returns ring records in the order they were sent), and around
    every send. The handler and ``codec.encode`` run outside it.

    Args:
        slots: the results the main process may hold at once; limit: the most the ring may hold
            (fewer slots where they would not fit; none: every result in a segment).
    """

    def __init__(self, channel: Channel, slots: int, limit: int) -> None:
        self.channel = channel
        self.rings: list[ShmRing] = []  # by index, as the main process knows them
        self._limit = limit
        self._lock = threading.Lock()
        self._closed = False
        self.written = 0  # results and errors sent: a worker that writes none for a while is idle
        # False: the main process is short of them (no segment, no new ring)
        self.descriptors = True
        self._unconfirmed: dict[
            int, OneOffSegment
        ] = {}  # segments sent, until main has mapped them
        self._asked = max(1, slots)
        self._more = 0  # slots added for results held beyond those asked for (HELD_MORE at most)
        self._ring: ShmRing | None = None  # the ring in use: None until the next result sizes it
        self._ring_index = -1  # its index in rings
        # the spare: a ring of one slot, made with the ring, written where its slots are all held
        self._spare: ShmRing | None = None
        self._spare_index = -1
        self._spare_at: float | None = None  # when it was last written (None: no pages held)
        self._sized = False  # whether that result came (a ring of no slots is none at all)
        # too large, of the last
        self._outgrown: collections.deque[bool] = collections.deque(maxlen=_SIZE_WINDOW)
        # no slot free, of the last
        self._all_held: collections.deque[bool] = collections.deque(maxlen=_SIZE_WINDOW)
        self._keep_slot = 0  # the slot size the next ring keeps (0: sized at its first result)
        # a budget binds: slots give their pages back once their result is released
        self._release = False
        # slots of the ring in use written since they gave their pages back (a new ring's first
        # is: its pages are allocated with the ring's), and when each was last written
        self._written: set[int] = set()
        self._written_at: dict[int, float] = {}
        self._next_cold = 0.0  # when to look for slots unwritten for IDLE_S next

    def confirmed(self, seqs: list[int]) -> None:
        """The main process has mapped these results' segments: let go of them here."""
        with self._lock:
            for seq in seqs:
                segment = self._unconfirmed.pop(seq, None)
                if segment is not None:
                    segment.close()

    def set_descriptors(self, allowed: bool, lost_ring: int | None = None) -> None:
        """Whether results may travel in descriptors (segments, new rings) from now on: False
        where the main process is at its open-files limit (``lost_ring``: the index of a ring
        whose descriptor it did not get; it takes no more records)."""
        with self._lock:
            self.descriptors = self.channel.descriptors = allowed
            self._descriptors_changed(lost_ring)

    def resend(self, seq: int, ring: int | None = None, offset: int = 0, nbytes: int = 0) -> None:
        """Send result ``seq`` again, in the channel: its segment's descriptor, or that of the ring
        it is in (``ring``, where it is the record at ``offset``), did not reach the main
        process, which cannot read it there. A ring record is released here, where the main
        process never mapped the ring."""
        with self._lock:
            if ring is None:
                segment = self._unconfirmed.pop(seq)
                payload = bytes(segment.buffer)
                segment.close()
            else:
                payload = bytes(self.rings[ring].view(offset, nbytes))
                self.rings[ring].release(offset, nbytes)
            self._send(("resent", seq, payload))

    def close(self, timeout: float = _CLOSE_S) -> None:
        """Close the rings; a task thread still running later finds the output closed.

        If a thread holds the lock past ``timeout`` s, the rings are left to the process's exit.
        """
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            self._closed = True
            for ring in self.rings:
                ring.close()
            for segment in self._unconfirmed.values():
                segment.close()
            self._unconfirmed.clear()
        finally:
            self._lock.release()

    def run(self, handler: Any, seq: int, payload: Any) -> None:
        """Run one task and send its result or error (``ChannelClosed`` if the main process is gone)."""
        clock = CallClock()
        with COUNTS.tally() as counts:
            try:
                encoded = codec.encode(handler(seq, payload))
            except Exception as e:  # noqa: BLE001 - sent to the main process, raised there
                packed = pack_exception(e)
                with self._lock:
                    self._send(("error", seq, packed, *_cost(clock, counts)))
                    self.written += 1
                return
        with self._lock:
            self._write(seq, encoded, _cost(clock, counts))
            self.written += 1

    def _add_ring(
        self, capacity: int, slot: int = 0, replaces: bool = False, first_slot: bool = True
    ) -> ShmRing:
        """A new ring, announced to the main process; ``replaces``: the older rings take no more
        records (the main process lets go of each once its records are back); ``first_slot``:
        its first slot's pages allocated now."""
        ring = ShmRing.create(capacity, slot, first_slot)
        if replaces:
            for old in self.rings:
                old.close()  # the main process's mapping stays while it holds records there
        self.rings.append(ring)
        self.channel.send(("ring_added", len(self.rings) - 1, replaces), [ring.fd])
        return ring

    def _write(self, seq: int, encoded: codec.EncodedRecord, cost: Cost) -> None:
        if self._closed:  # the worker is stopping: its rings are gone
            raise ChannelClosed("the worker is stopping")
        nbytes = encoded.nbytes
        self._give_back_released()
        placed = self._reserve(nbytes)
        if placed is None and not self.descriptors:
            payload = bytearray(nbytes)
            encoded.write_into(memoryview(payload))
            self._send(("bytes", seq, payload, *cost))
            return
        if placed is None:
            segment = OneOffSegment.create(nbytes)
            try:
                encoded.write_into(segment.buffer)
                self._send(("segment", seq, nbytes, *cost), [segment.fd])
            except BaseException:
                segment.close()
                raise
            self._unconfirmed[seq] = segment  # until the main process says it mapped it
            return
        index, reservation = placed
        encoded.write_into(reservation.buffer)
        offset, nbytes = self.rings[index].commit(reservation)
        now = time.monotonic()
        if index == self._spare_index:
            self._spare_at = now
        else:
            self._written.add(offset)
            self._written_at[offset] = now
        self._send(("ring", seq, index, offset, nbytes, *cost))
        self._give_back_cold(now)

    def _send(self, message: tuple, fds: list[int] | tuple[int, ...] = ()) -> None:
        if self._closed:  # the worker is stopping: nobody reads the result
            raise ChannelClosed("the worker is stopping")
        self.channel.send(message, fds)

    @property
    def _slots(self) -> int:
        return self._asked + self._more

    def set_slots(self, slots: int) -> None:
        """The results the main process may hold from this worker at once, from now on."""
        with self._lock:
            if max(1, slots) != self._asked:
                self._asked = max(1, slots)
                # the next result sizes a new ring (none can be sent without descriptors); until
                # then this one stays, and gives its pages back when idle or under a budget
                self._sized = not self.descriptors

    def _descriptors_changed(self, lost_ring: int | None) -> None:
        """Descriptors were allowed or not (:attr:`descriptors`); the lock is held."""
        if self.descriptors:
            self._sized = False  # the next result sizes a ring again
        elif lost_ring is not None and self._ring is self.rings[lost_ring]:
            self._ring = None  # every result in the channel
        elif lost_ring is not None and self._spare is self.rings[lost_ring]:
            self._spare = None

    def set_slot_pages(self, keep: bool) -> None:
        """Whether slots keep their pages once the main process released their result (no page
        faults when they are written again) or give them back (a memory budget binds: the ring
        then holds what is in flight, as torch's DataLoader holds its batches, and no slot more
        for results the consumer keeps)."""
        with self._lock:
            self._release = not keep
            if self._release and self._more:
                self._more, self._sized = (
                    0,
                    False,
                )  # the next result makes a ring of the slots asked for
        self.give_back_released()

    @property
    def releasing(self) -> bool:
        """Whether slots give their pages back once released (a memory budget binds)."""
        return self._release

    def give_back_released(self) -> int:
        """Under a budget that binds, give back the pages of the slots written since they last
        did and released since. Returns the bytes given back."""
        with self._lock:
            return self._give_back_released()

    def _give_back_released(self) -> int:
        ring = self._ring
        if not self._release or self._closed or ring is None:
            return 0
        given = self._give_back_spare()
        if not self._written:
            return given
        released = ring.free_slots() & self._written
        self._written -= released
        return given + (ring.give_back_free_slots(only=released) if released else 0)

    def _give_back_spare(self) -> int:
        """The spare's slot gives its pages back if it holds none (the lock is held)."""
        spare = self._spare
        if spare is None or self._spare_at is None or not spare.free_slots():
            return 0
        self._spare_at = None
        return spare.give_back_free_slots()

    def _give_back_cold(self, now: float) -> None:
        """Slots unwritten for :data:`IDLE_S` give their pages back (the lock is held): a consumer
        that keeps up empties the ring before each result, which then goes to its first slot
        (``ShmRing``'s rewind), so the ring holds what is in flight, not every slot it has."""
        ring = self._ring
        if now < self._next_cold or ring is None or self._closed:
            return
        self._next_cold = now + IDLE_S / 4
        if self._spare_at is not None and now - self._spare_at >= IDLE_S:
            self._give_back_spare()
        cold = {o for o in self._written if now - self._written_at.get(o, now) >= IDLE_S}
        cold &= ring.free_slots()
        if cold:
            self._written -= cold
            ring.give_back_free_slots(only=cold)

    def give_back_idle(self) -> int:
        """The worker has been idle a while: give back the pages of slots that hold no result
        (the next result written to one faults its pages in again). Returns the bytes given back."""
        with self._lock:
            if self._closed or self._ring is None:
                return 0
            # a slot the main process still holds is given back once released, under a budget
            self._written -= self._ring.free_slots()
            return self._give_back_spare() + self._ring.give_back_free_slots()

    def _reserve(self, nbytes: int) -> tuple[int, Reservation] | None:
        """Room for a record of ``nbytes`` in the ring (the lock is held); None: a one-off segment
        (or, with no descriptors, the channel: then no ring is added)."""
        if not self.descriptors:
            return self._in_ring(nbytes)
        if self._ring is not None:
            self._outgrown.append(not self._ring.fits(nbytes))
            if sum(self._outgrown) >= _RESIZE_AFTER:
                self._sized = False
        if not self._sized:
            self._size_ring(nbytes)
        ring = self._ring
        if ring is None or not ring.fits(nbytes):
            return None
        spare = self._spare  # a slot of its own for a result held beyond the ring's
        reservation = ring.reserve(nbytes, timeout=0.0 if spare is not None else RING_GRACE_S)
        if reservation is None and spare is not None:
            found = spare.reserve(nbytes, timeout=RING_GRACE_S)
            if found is not None:
                self._all_held.append(False)
                return self._spare_index, found
        self._all_held.append(reservation is None)
        if sum(self._all_held) >= _HELD_AFTER and self._more < HELD_MORE and not self._release:
            self._more, self._sized = (
                self._more + 1,
                False,
            )  # the next result makes a ring with one more
            self._keep_slot = ring.slot_bytes  # of these slots (that result may be an odd one)
        return (self._ring_index, reservation) if reservation is not None else None

    def _in_ring(self, nbytes: int) -> tuple[int, Reservation] | None:
        """Room in the ring as it is (none is added: no descriptor can be sent)."""
        ring = self._ring
        reservation = (
            ring.reserve(nbytes, timeout=RING_GRACE_S)
            if ring is not None and ring.fits(nbytes)
            else None
        )
        return (
            (self.rings.index(ring), reservation)
            if ring is not None and reservation is not None
            else None
        )

    def _size_ring(self, nbytes: int) -> None:
        """Make the ring for results like one of ``nbytes`` (none where a slot exceeds the limit)."""
        self._sized, self._ring = True, None
        self._written.clear()
        self._written_at.clear()
        self._outgrown.clear()
        self._all_held.clear()
        slot, self._keep_slot = self._keep_slot or slot_bytes(nbytes), 0
        slots = min(self._slots, self._limit // slot)
        # the last slot is a spare ring's: a ring turns through all its slots while it never
        # empties, so one whose results the consumer takes as they come (two at most in use at
        # once, of three) kept all three resident; the spare is written only where the consumer
        # held one more, and goes cold otherwise
        self._spare, self._spare_index, self._spare_at = None, -1, None
        ring_slots = slots - 1 if slots >= 2 else slots
        if ring_slots:
            self._ring = self._add_ring(ring_slots * slot, slot, replaces=bool(self.rings))
            self._ring_index = len(self.rings) - 1
            self._written = {0}  # allocated with the ring; the others as they are written
            self._written_at = {0: time.monotonic()}
        if slots >= 2:  # its slot allocated as it is first written
            self._spare = self._add_ring(slot, slot, first_slot=False)
            self._spare_index = len(self.rings) - 1


def _cost(clock: CallClock, counts: Tally) -> Cost:
    """``(start, wall seconds, CPU seconds, run delay, counts)`` of a task, always a message's last
    five fields: the start (``perf_counter``, one clock for all processes) places it in a trace;
    the run delay is the seconds it waited for a core; the counts are what the task counted
    (None: nothing, the usual case). A task that waited for another task first (``timing.waited``)
    starts once it waited."""
    return (clock.wall + clock.waited_s(), *clock.spent(), counts or None)


def pack_exception(exc: BaseException) -> tuple[bytes | None, str, str, str]:
    """An exception as (pickle or None, type name, message, traceback text), for another process."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
        data = None
    return data, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text

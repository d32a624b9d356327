import ctypes
import gc
import mmap
import random
import time

import numpy as np
import pytest
import torch

from tests.runtime.processes.test_pool import fresh_tensor, run_all
from torchpipe.runtime import codec
from torchpipe.runtime.processes import output
from torchpipe.runtime.processes import worker as worker_module
from torchpipe.runtime.processes.output import slot_bytes
from torchpipe.runtime.processes.pool import ProcessPool, process_executor_supported
from torchpipe.testing import worker_rings

pytestmark = pytest.mark.skipif(not process_executor_supported(), reason="needs fork and memfd")

PAGE = mmap.PAGESIZE


def filled(seq, n):
    """``n`` float64s, each ``seq``: 8n bytes, and which element it was."""
    return torch.full((n,), float(seq), dtype=torch.float64)


def encoded_bytes(n):
    return codec.encode(filled(0, n)).nbytes


def segments_open():
    """One-off segments mapped in this process (mapped while it holds one's result; no
    descriptor is held for them: the open-files limit)."""
    with open("/proc/self/maps") as maps:
        return sum("/memfd:torchpipe-segment" in line for line in maps)


def resident_bytes(ring):
    """Bytes of an attached ring's pages in memory, read from this process's mapping of it (the
    consumer holds no descriptor of the ring to ask): ``mincore`` tells which of the memfd's
    pages are resident, whether this process touched them or not."""
    words = np.frombuffer(ring._words, np.uint64)
    pages = -(-words.nbytes // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.c_void_p(words.ctypes.data)
    if libc.mincore(address, ctypes.c_size_t(words.nbytes), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore of the ring's mapping")
    return sum(page & 1 for page in vector) * PAGE


def test_a_slot_holds_a_record_of_its_first_result_with_headroom_in_whole_pages():
    assert slot_bytes(0) == PAGE
    for n in (1, PAGE - 8, PAGE, 100_000, 38 << 20):
        need = n + min(n // output.SLOT_HEADROOM, output.MAX_HEADROOM_BYTES) + 8
        assert slot_bytes(n) % PAGE == 0 and need <= slot_bytes(n) < need + PAGE + 64


def resident(rings):
    """The resident bytes of a worker's ring and its spare."""
    return sum(resident_bytes(ring) for ring in rings)


@pytest.mark.parametrize(
    ("per_worker", "allocate", "held", "slots"),
    [
        (2, None, None, 3),
        (3, None, None, 4),
        (2, fresh_tensor, None, 2),
        (2, None, 0, 2),
        (1, None, 2, 3),
    ],
)
def test_a_workers_ring_has_a_slot_for_each_result_the_consumer_may_hold(
    per_worker, allocate, held, slots
):
    """Its tasks in flight, and the result the consumer holds unless each is copied out at once."""
    pool = ProcessPool(filled, 1, "m", per_worker=per_worker, allocate=allocate, held=held)
    pool.start()
    try:
        # no ring before the first result
        assert pool.capacity == per_worker and pool.ring_bytes == 0
        run_all(pool, [5000])
        assert pool.ring_bytes == slots * slot_bytes(encoded_bytes(5000))
    finally:
        pool.close()


def test_results_of_any_size_arrive_once_and_intact_and_the_ring_grows_only_by_its_held_slots():
    rng = random.Random(0)
    pool = ProcessPool(filled, 2, "m", per_worker=2)
    pool.start()
    try:
        # the first result sizes the ring (a worker's; the other's is sized below)
        run_all(pool, [20_000])
        run_all(pool, [20_000] * 4)
        rings = pool.ring_bytes
        assert rings == 2 * 3 * slot_bytes(encoded_bytes(20_000))
        held = []
        for _ in range(4):
            # every 6th too large for a slot: too few to size the ring again (half the last 16 would)
            sizes = [
                60_000 if i % 6 == 5 else rng.choice([0, 7, 19_000, 20_000, 21_000])
                for i in range(12)
            ]
            results = run_all(pool, sizes)
            for seq, n in enumerate(sizes):
                value, error = results[seq]
                assert error is None and torch.equal(value, filled(seq, n))
            held += [
                value for value, _ in results.values() if rng.random() < 0.5
            ]  # hold some, free the rest
            del results
            rng.shuffle(held)
            del held[: len(held) // 2]
            # larger results took segments; held ones too, or slots the ring added (HELD_MORE a worker)
            assert (
                rings
                <= pool.ring_bytes
                <= 2 * (3 + output.HELD_MORE) * slot_bytes(encoded_bytes(20_000))
            )
    finally:
        pool.close()


def test_a_result_too_large_for_a_slot_takes_a_segment_freed_when_released():
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        run_all(pool, [1000])
        rings = pool.ring_bytes
        before = segments_open()
        value = run_all(pool, [100_000])[0][0]
        assert torch.equal(value, filled(0, 100_000)) and segments_open() > before
        del value
        gc.collect()
        assert segments_open() == before and pool.ring_bytes == rings
    finally:
        pool.close()


def test_an_idle_worker_gives_back_its_free_slots_pages_and_faults_them_in_again_when_written(
    monkeypatch,
):
    """Between epochs (or while the loop evaluates) the rings hold no batch the loop needs: their
    free slots give their pages back, as torch's DataLoader holds no batch then. A slot the
    consumer still holds keeps its result intact."""
    monkeypatch.setattr(worker_module, "IDLE_S", 0.2)  # the zygote, forked at start, reads it
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        n = 1 << 20  # 8 MB results: a ring of 2 slots and a spare of 1
        results = run_all(pool, [n] * 6)
        kept = results[5][0]
        del results
        gc.collect()
        ring, spare = rings = worker_rings(pool)[0][-2:]
        # held at once: every slot written (a slot's pages are allocated as they are written)
        assert (ring.slots, spare.slots) == (2, 1) and resident(rings) >= 3 * 8 * n
        deadline = time.monotonic() + 20
        while resident(rings) > ring.slot_bytes + 4 * PAGE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident(rings) <= ring.slot_bytes + 4 * PAGE  # the held slot's pages stay
        assert torch.equal(kept, filled(5, n))
        del kept
        gc.collect()
        again = run_all(pool, [n] * 3)
        assert all(torch.equal(again[seq][0], filled(seq, n)) for seq in range(3))
        assert resident(rings) >= 2 * 8 * n  # written again: faulted in
    finally:
        pool.close()


def test_slots_a_consumer_that_keeps_up_leaves_unwritten_give_their_pages_back(monkeypatch):
    """#58: a consumer that takes each result before the next is made empties the ring each time;
    the results then all go to its first slot, and the slots written while it fell behind give
    their pages back once unwritten for IDLE_S, while results keep coming."""
    monkeypatch.setattr(output, "IDLE_S", 0.2)  # the zygote, forked at start, reads it
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        n = 1 << 18  # 2 MB results: a ring of 2 slots and a spare of 1
        held = run_all(pool, [n] * 3)  # fell behind: every slot written
        ring, _ = rings = worker_rings(pool)[0][-2:]
        assert resident(rings) >= 3 * 8 * n
        del held
        gc.collect()
        deadline = time.monotonic() + 20
        kept_up = 0
        while resident(rings) > ring.slot_bytes + 4 * PAGE and time.monotonic() < deadline:
            (value, error) = run_all(pool, [n])[0]  # taken, then let go, before the next
            assert error is None and torch.equal(value, filled(0, n))
            del value
            kept_up += 1
            time.sleep(0.01)
        assert resident(rings) <= ring.slot_bytes + 4 * PAGE  # the first slot only
        assert kept_up >= 1  # while results kept coming (a task each ~10 ms: never idle)
        held = run_all(pool, [n] * 3)  # behind again: the slots are written again
        assert all(torch.equal(value, filled(seq, n)) for seq, (value, _) in held.items())
        assert resident(rings) >= 3 * 8 * n
    finally:
        pool.close()


def test_a_ring_sized_at_an_atypical_first_result_is_sized_again_once_most_results_outgrow_it():
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        run_all(pool, [10])  # a small first result
        small = pool.ring_bytes
        assert small == 3 * slot_bytes(encoded_bytes(10))
        run_all(pool, [50_000] * 7)  # outgrowing it, but not yet for most of the last 16
        assert pool.ring_bytes == small
        values = run_all(pool, [50_000] * 3)
        assert pool.ring_bytes == 3 * slot_bytes(encoded_bytes(50_000))  # replaced, as many slots
        assert all(torch.equal(values[s][0], filled(s, 50_000)) for s in values)
    finally:
        pool.close()


def test_a_new_tasks_in_flight_count_takes_effect_with_a_ring_of_as_many_slots():
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        run_all(pool, [3000])
        slot = slot_bytes(encoded_bytes(3000))
        assert pool.ring_bytes == 3 * slot
        held = run_all(pool, [3000])[0][0]  # a record of the old ring, still held
        pool.set_per_worker(5)
        assert pool.per_worker == 5 and pool.capacity == 5
        values = run_all(pool, [3000] * 7)
        assert pool.ring_bytes == 6 * slot  # the old ring is let go, though `held` still views it
        assert torch.equal(held, filled(0, 3000)) and all(
            torch.equal(values[s][0], filled(s, 3000)) for s in values
        )
        with pytest.raises(ValueError, match="tasks in flight per worker must be an int >= 1"):
            pool.set_per_worker(0)
        with pytest.raises(ValueError, match="results held must be an int >= 0"):
            ProcessPool(filled, 1, "m", held=-1, fork_now=False)
    finally:
        pool.close()


def test_results_held_besides_those_in_flight_can_be_set_and_the_ring_follows():
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        run_all(pool, [3000])
        slot = slot_bytes(encoded_bytes(3000))
        assert pool.ring_bytes == 3 * slot  # 2 in flight and 1 the consumer holds
        pool.set_held(0)  # the consumer's results are counted in flight (a prefetch above)
        values = run_all(pool, [3000] * 4)
        assert pool.ring_bytes == 2 * slot and pool.capacity == 2
        assert all(torch.equal(values[s][0], filled(s, 3000)) for s in values)
        with pytest.raises(ValueError, match="results held must be an int >= 0"):
            pool.set_held(-1)
    finally:
        pool.close()


def test_a_consumer_that_steadily_holds_more_results_than_it_said_gets_a_slot_for_each_up_to_a_limit():
    """As a prefetch buffer above a map does, or a loop that keeps its first batch: with every slot
    held, results take one-off segments (a copy and page faults more each); where that is steady
    the ring adds a slot, one at a time, up to HELD_MORE, and results land in slots again."""
    pool = ProcessPool(filled, 1, "m", per_worker=2)  # 2 in flight + 1 held: 3 slots
    pool.start()
    try:
        slot = slot_bytes(encoded_bytes(3000))
        kept = [
            (s, v) for s, (v, _) in run_all(pool, [3000, 3000]).items()
        ]  # kept: 2 slots stay held
        for _ in range(30):
            run_all(pool, [3000, 3000])  # 2 in flight beside them: 4 needed
        assert pool.ring_bytes == 4 * slot  # one more, no more
        before = segments_open()
        values = run_all(pool, [3000, 3000])
        assert segments_open() == before  # in the ring again
        kept += [
            (s, v) for _ in range(40) for s, (v, _) in run_all(pool, [3000]).items()
        ]  # keeps everything
        assert pool.ring_bytes == (3 + output.HELD_MORE) * slot  # the limit: the rest in segments
        assert all(torch.equal(v, filled(s, 3000)) for s, v in kept) and len(values) == 2
    finally:
        pool.close()


def test_a_consumer_that_holds_one_result_while_the_next_comes_keeps_two_slots_resident():
    """#58: 2 in flight and 1 held make 3 slots, but a consumer that holds one result while the
    next arrives has 2 in use at once. A ring turns through all its slots while it never
    empties: the third slot is a spare ring's, written only where a third is held."""
    pool = ProcessPool(filled, 1, "m", per_worker=2)
    pool.start()
    try:
        n = 1 << 18  # 2 MB results
        last = run_all(pool, [n])[0][0]
        for _ in range(12):  # the last one held while the next is made and taken
            value, error = run_all(pool, [n])[0]
            assert error is None and torch.equal(value, filled(0, n))
            last = value
        ring, spare = worker_rings(pool)[0][-2:]
        assert ring.slots == 2 and spare.slots == 1
        assert resident_bytes(spare) <= PAGE  # never written (its header page only)
        assert resident_bytes(ring) >= 2 * 8 * n
        held = run_all(pool, [n] * 3)  # three held at once: the spare's slot too, no segment
        assert all(torch.equal(v, filled(s, n)) for s, (v, _) in held.items())
        assert resident_bytes(spare) >= 8 * n and torch.equal(last, filled(0, n))
    finally:
        pool.close()

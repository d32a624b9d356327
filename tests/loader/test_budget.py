"""What the DataLoader's worker iterator does for its RAM budget (loader/budget.py): workers and
ring slots given up past it, batches made here counted, a user's count kept with one warning,
and what each move leaves behind."""

import time
import types
import warnings
import weakref

import psutil
import torch

import torchpipe as tp
from tests.loader.test_memory import Busy, SlotPool, wait_until
from tests.runtime.processes.test_output import PAGE, resident_bytes
from torchpipe.loader import budget as budget_module
from torchpipe.loader import memory as loader_memory
from torchpipe.loader.budget import BudgetedWorkers, held_here
from torchpipe.loader.memory import LoaderMemory, hold_peak, predicted_peak
from torchpipe.runtime.processes.output import slot_bytes
from torchpipe.testing import forced_call_costs, move_calls, worker_rings


def test_what_this_process_holds_for_an_iterator_is_nothing_once_it_is_gone():
    loader = tp.DataLoader(Waits(), batch_size=4, num_workers="auto")
    it = iter(loader)
    assert held_here(lambda: it) >= 0.0 and held_here(lambda: None) == 0.0


def test_over_its_budget_a_loader_gives_up_workers_then_slots_and_loses_no_batch(monkeypatch):
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)  # shed a step at each reading
    monkeypatch.setattr(loader_memory, "CHECK_EVERY_S", 0.01)

    def make(**kwargs):
        return tp.DataLoader(
            Busy(), batch_size=4, generator=torch.Generator().manual_seed(3), **kwargs
        )

    # per-batch seeds: the same draws anywhere
    ref = make(num_workers="auto", persistent_workers=True)
    want = [[b.tolist() for b in ref] for _ in range(3)]
    before = {
        p.pid for p in psutil.Process().children(recursive=True)
    }  # ref's persistent workers among them
    lean = make(
        num_workers="auto", autotune=tp.AutotuneOptions(ram_budget=1), persistent_workers=True
    )
    for epoch in range(3):  # each batch once, in order, with its draws, while workers go
        it = iter(lean)
        if epoch == 0:
            move_calls(it, "process", 3)
            assert it.placement.workers == 1  # the cap the predicted peak set
        assert [b.tolist() for b in it] == want[epoch]
    memory = lean.stats()[0]["memory"]
    assert memory["default"] is False and memory["budget"] == 1
    shed = memory["shed"]
    assert shed and shed[-1] == "the workers' zygote"  # no worker process fits in one byte
    steps = [s.split(":")[0] for s in shed]
    # held on the predicted peak: capped at one worker before the first move (3 asked), one
    # batch in flight (its slots kept), then its slots' pages given back once released, then
    # the last worker
    assert steps[:3] == ["workers past 1", "batches in flight", "slot pages"], shed
    assert steps.index("the last worker") > 2 and "a ring slot" not in steps
    assert lean.stats()[0]["executor"] == "inline"  # capped at 0 by the budget, whatever measured
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left  # nor the workers' zygote, once they are gone


class Waits(torch.utils.data.Dataset):
    """1 MB items that wait (GIL-free) and draw from no RNG: threads suit them."""

    def __init__(self, length=48):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.full((256, 1024), float(i))


def test_batches_made_on_threads_and_not_handed_out_count_against_the_budget(monkeypatch):
    """A batch a thread made waits in this process until the loop takes it: the loader's, as a
    batch in a worker's ring is. With no worker process at all, the readings see them and the
    loader gives up threads down to inline."""
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)
    monkeypatch.setattr(loader_memory, "CHECK_EVERY_S", 0.01)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = tp.DataLoader(
        Waits(),
        batch_size=4,
        num_workers="auto",
        persistent_workers=True,
        autotune=tp.AutotuneOptions(ram_budget=1 << 20),
    )
    # 4 MB batches, GIL-free: a thread a core
    with forced_call_costs(0.012, gil_free=1.0, moves=False):
        it = iter(loader)
    # where the forced costs put it, no window moving it
    assert loader.stats()[0]["executor"] == "thread"
    want = [[float(i) for i in range(j, j + 4)] for j in range(0, 48, 4)]
    epoch, deadline = 0, time.monotonic() + 30  # epochs until the threads are all given up, however
    while epoch == 0 or (
        loader.stats()[0]["executor"] != "inline" and time.monotonic() < deadline
    ):  # loaded
        assert [
            b[:, 0, 0].tolist() for b in (it if epoch == 0 else loader)
        ] == want  # each batch once, in order
        epoch += 1
    memory = loader.stats()[0]["memory"]
    forked = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert memory["peak"] > 1 << 20 and not forked  # read with no worker process
    steps = [step.split(":")[0] for step in memory["shed"]]
    # threads capped at their predicted peak ("workers past 1") or given up at a reading ("worker 2 of 2")
    assert steps[0].startswith("worker") and "the last worker" in steps
    assert loader.stats()[0]["executor"] == "inline"


def test_a_worker_count_the_user_chose_is_kept_past_the_budget_with_one_warning(monkeypatch):
    """Past the budget the slots give their pages back first (the count is kept); still past
    it, a warning says once what the loader holds."""
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)
    monkeypatch.setattr(loader_memory, "CHECK_EVERY_S", 0.01)
    loader = tp.DataLoader(
        Busy(), batch_size=4, num_workers=2, autotune=tp.AutotuneOptions(ram_budget=1)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [b for _ in range(2) for b in loader]
    assert len(got) == 2 * 60  # nothing lost
    said = [
        str(w.message) for w in caught if "worker processes and their rings hold" in str(w.message)
    ]
    assert (
        len(said) == 1
        and "num_workers is yours and is kept" in said[0]
        and "its ram_budget" in said[0]
    )
    memory = loader.stats()[0]["memory"]
    assert loader.stats()[0]["workers"] == 2 and memory["slot_pages"] == "released"
    assert (
        memory["shed"][0].startswith("slot pages: released")
        and "2 workers kept" in memory["slot_pages_why"]
    )


def test_moved_to_worker_processes_the_main_process_lets_go_of_the_buffers_it_kept_for_batches():
    """Batches of 1 MB or more made here are stacked into buffers kept for reuse; once the workers
    make the batches, those buffers would be held for nothing."""
    loader = tp.DataLoader(Waits(), batch_size=4, num_workers="auto")
    # cheap calls: the first batches are made here, and stay wherever the test moves them (a
    # loaded machine's windows would move them on; measured, the first batches may go to workers)
    with forced_call_costs(1e-5, gil_free=0.0, moves=False):
        it = iter(loader)
    move_calls(it, "inline", 0)
    kept = [next(it) for _ in range(3)]
    del kept  # their buffers come back: one is kept (batches are made one at a time here)
    assert it.kept_bytes == 4 << 20
    move_calls(it, "process", 2)
    assert it.kept_bytes == 0
    assert [b[:, 0, 0].tolist() for b in it] == [
        [float(i) for i in range(j, j + 4)] for j in range(12, 48, 4)
    ]


def test_workers_parked_for_a_trial_elsewhere_give_their_slots_pages_back_until_the_calls_return():
    """A trial on threads or inline while the workers wait parked: their rings' pages and this
    process's batches would peak together, so the parked slots give their pages back as their
    batches are taken, and keep them again once the workers make the batches; no batch is lost."""
    loader = tp.DataLoader(Waits(length=160), batch_size=4, num_workers="auto")
    with forced_call_costs(2e-2, gil_free=0.0, moves=False):  # held where the test moves them
        it = iter(loader)
    move_calls(it, "process", 2)
    got = [next(it) for _ in range(16)]  # the measured batches (made here), then the workers'
    pool = it._pool
    assert pool.slot_pages and pool.size == 2 and all(worker_rings(pool))
    move_calls(it, "inline", 0)
    assert not pool.slot_pages and pool.size == 2  # parked, its pages given back
    got += [next(it) for _ in range(8)]
    del got[:]  # the loop let go of the workers' batches: their slots' pages go

    def resident() -> list[int]:  # a worker may have replaced its ring meanwhile
        return [resident_bytes(ring) for rings in worker_rings(pool) for ring in rings]

    assert wait_until(lambda: all(n <= 4 * PAGE for n in resident())), resident()
    move_calls(it, "process", 2)
    assert pool.slot_pages  # the workers make the batches again: their slots keep their pages
    assert [b[:, 0, 0].tolist() for b in it] == [
        [float(i) for i in range(j, j + 4)] for j in range(96, 160, 4)
    ]


def test_a_worker_placements_predicted_peak_leaves_out_what_batches_made_here_hold(monkeypatch):
    """What this process holds for batches made here (those its threads made and the memory
    kept to stack the next) goes when the batches move to worker processes: a worker placement's
    predicted peak counts what this process holds only while the batches are made there."""
    predicted = []  # (this process's share the peak was predicted with, what it held then)
    made = []  # the iterator, once made

    def hold_peak(memory, pool, workers, batch, here):
        if made:
            predicted.append((here, held_here(weakref.ref(made[0]))))
        return real(memory, pool, workers, batch, here)

    real = budget_module.hold_peak
    monkeypatch.setattr(budget_module, "hold_peak", hold_peak)
    loader = tp.DataLoader(Waits(length=800), batch_size=4, num_workers="auto")
    # the moves are this test's: a first decision measured on a loaded machine went to
    # processes, and the move to them below then started no worker
    with forced_call_costs(0.012, gil_free=1.0, moves=False):
        it = iter(loader)
    made.append(it)
    next(it)
    move_calls(it, "thread", 2)
    held = []
    for _ in range(60):  # the threads run ahead: batches made here wait, memory is kept
        next(it)
        held.append(held_here(weakref.ref(it)))
        if held[-1] > 0:
            break
    assert it.placement.kind == "thread" and held[-1] > 0
    predicted.clear()
    move_calls(it, "process", 1)
    assert predicted and predicted[0][0] == 0.0 and predicted[0][1] > 0  # the move's peak
    predicted.clear()
    # on processes, the peak is judged again at each reading: what this process holds counts
    for _ in it:
        if predicted:
            break
    assert it.placement.kind == "process"
    assert predicted and all(here == now for here, now in predicted)
    made.clear()
    del it  # its workers go with it


class InFlightPool(SlotPool):
    def set_per_worker(self, n):
        self.per_worker = n


class Budgeted(BudgetedWorkers):
    """The budget's part of a worker iterator, over a pool without processes."""

    def __init__(self, memory, pool, factor=2, auto=True):
        self._memory, self._pool = memory, pool
        # num_workers="auto" has a placement, no cap here
        self._placement = types.SimpleNamespace(most=None) if auto else None
        self._factor = self._asked_factor = factor


def test_a_budget_that_binds_keeps_one_batch_in_flight_a_worker_before_any_slot_faults(monkeypatch):
    """With num_workers="auto", where 2 workers' slots with prefetch_factor batches in flight
    each are predicted past the budget and with one batch each are not: one batch in flight a
    worker, every slot keeping its pages (no page faults; a slot less than released ones hold);
    prefetch_factor again once a budget has room for it. A count the user chose keeps its
    prefetch_factor (its slots give their pages back instead)."""
    monkeypatch.setattr(loader_memory, "SETTLE_S", 0.0)
    batch = 8 * 2**20
    pool = InFlightPool(size=2)
    memory = LoaderMemory(budget=1.0, given=True)
    memory.alone = {11: batch, 12: batch}
    full = predicted_peak(memory, pool, 2, batch, 0.0, kept=True)
    one = predicted_peak(memory, pool, 2, batch, 0.0, kept=True, in_flight=1)
    assert one == full - 2 * slot_bytes(batch)
    assert one < predicted_peak(memory, pool, 2, batch, 0.0, kept=False)  # fewer than released
    memory.budget = (one + full) / 2
    budgeted = Budgeted(memory, pool)
    budgeted._fit_in_flight(2, batch, 0.0)
    assert pool.per_worker == 1 and memory.report()["in_flight"] == 1
    assert not hold_peak(memory, pool, 2, batch, 0.0) and pool.switched == []  # pages kept
    assert not budgeted._parks()  # a budget binds: no workers kept up during a trial elsewhere
    report = memory.report()
    assert report["in_flight"] == 1 and "past the budget" in report["in_flight_why"]
    assert report["shed"][-1].startswith("batches in flight: 1 a worker, their slots kept")
    budgeted._fit_in_flight(2, batch, 0.0)  # between: as it is
    assert pool.per_worker == 1
    memory.budget = full / loader_memory.ROOM_SHARE + 2**20  # the budget frees
    memory.held = batch  # and the last reading has the room
    budgeted._fit_in_flight(2, batch, 0.0)
    assert pool.per_worker == 2 and memory.report()["in_flight"] == 2
    assert budgeted._parks()
    assert "within 80%" in memory.report()["in_flight_why"]
    user_memory, user_pool = LoaderMemory(budget=(one + full) / 2, given=True), InFlightPool(2)
    user_memory.alone = memory.alone
    fixed = Budgeted(user_memory, user_pool, auto=False)
    fixed._fit_in_flight(2, batch, 0.0)
    assert user_pool.per_worker == 2 and user_memory.report()["in_flight"] is None


def test_under_a_budget_that_binds_a_move_waits_for_the_executor_left_to_finish():
    """While the budget binds, the calls' next executor gets no batch until the one they left has
    finished its own: the memory of both (a trial's threads' batches and the workers' heaps)
    never peaks together. No batch is lost or repeated."""
    loader = tp.DataLoader(Waits(length=200), batch_size=4, num_workers="auto")
    with forced_call_costs(2e-2, gil_free=0.0, moves=False):  # held where the test moves them
        it = iter(loader)
    move_calls(it, "process", 2)
    got = [next(it)[:, 0, 0].tolist() for _ in range(12)]
    it._parks = lambda: False  # the budget binds (its cap, fewer in flight or released pages)
    dispatch = it._dispatch
    submit, sent_while_draining = dispatch.submit, []

    def spy(*args, **kwargs):
        sent_while_draining.append(dispatch.draining)
        return submit(*args, **kwargs)

    dispatch.submit = spy
    move_calls(it, "thread", 2)
    got += [b[:, 0, 0].tolist() for b in it]
    assert got == [[float(i) for i in range(j, j + 4)] for j in range(0, 200, 4)]
    assert sent_while_draining and not any(sent_while_draining)

"""How an IterableDataset's epoch under ``num_workers="auto"`` reads its replicas' first batches
(loader/replica_starts.py): their costs, forced or measured, and when they count as waiting on I/O.
The decisions they lead to are tests/loader/test_replicas.py's."""

from torchpipe.loader.replica_starts import _waits_on_io, replica_costs
from torchpipe.runtime.placement.costs import CallCosts
from torchpipe.runtime.placement.measure import forced_costs
from torchpipe.runtime.timing import CallTiming


class Pool:
    """What replica_costs reads of a pool: its call timing and its worker pids (none here)."""

    def __init__(self, calls, wall_s, cpu_s):
        self.timing, self.pids = CallTiming(), []
        for _ in range(calls):
            self.timing.add(wall_s / calls, cpu_s / calls)


def test_the_first_batches_cost_what_their_calls_were_timed_at():
    calls, wall_s, cpu_s, asleep = replica_costs(Pool(4, 0.4, 0.1))
    assert (calls, asleep) == (4, 0)
    assert abs(wall_s - 0.4) < 1e-9 and abs(cpu_s - 0.1) < 1e-9


def test_within_forced_costs_they_cost_what_is_forced_and_sleep_as_they_wait():
    with forced_costs(CallCosts(0.01, 0.002, 1.0, 1e-6)):
        calls, wall_s, cpu_s, asleep = replica_costs(Pool(5, 5.0, 5.0))
    assert calls == 5 and abs(wall_s - 0.05) < 1e-9 and abs(cpu_s - 0.01) < 1e-9
    assert _waits_on_io(calls, wall_s, cpu_s, asleep)  # 80% waiting, asleep 16 times in 5 calls
    assert replica_costs(Pool(5, 5.0, 5.0))[1] == 5.0  # measured again after the block


def test_batches_wait_on_io_only_where_most_of_their_time_is_asleep_and_long_enough():
    assert _waits_on_io(10, 0.1, 0.01, 40)  # 9 ms a batch off the CPU, asleep 4 times a batch
    assert not _waits_on_io(10, 0.1, 0.01, 30)  # a busy machine's waits: not asleep on their own
    assert not _waits_on_io(10, 0.1, 0.05, 40)  # CPU-bound: waited less than 3x its CPU time
    assert not _waits_on_io(10, 0.015, 0.001, 40)  # under 2 ms a batch of waiting
    assert not _waits_on_io(0, 0.0, 0.0, 0)  # nothing measured yet

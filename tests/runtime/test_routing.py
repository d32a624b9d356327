"""Central dispatch's rule, shared by the process pool and the Ray pool."""

from torchpipe.runtime.routing import MAX_TASK_FAILURES, Task, TaskRouter


class _Worker:
    def __init__(self, slot, ready=True, retiring=False, busy=0):
        self.slot, self.ready, self.retiring = slot, ready, retiring
        self.tasks = {-1 - i: None for i in range(busy)}


def _route(router, workers, limit=2, slot_of=None):
    routed = router.route(workers, limit, slot_of)
    for worker, task in routed:
        worker.tasks[task.seq] = task
    return [(worker.slot, task.seq) for worker, task in routed]


def test_free_tasks_go_to_the_least_busy_ready_worker_up_to_the_limit():
    router = TaskRouter()
    for seq in range(6):
        router.add(Task(seq, seq))
    workers = [_Worker(0, busy=1), _Worker(1), _Worker(2, ready=False), _Worker(3, retiring=True)]
    assert _route(router, workers) == [(1, 0), (0, 1), (1, 2)]
    assert len(router) == 3 and router.holds(3) and not router.holds(0)


def test_a_slots_tasks_wait_for_its_worker_in_order_and_others_pass_them():
    router = TaskRouter()
    router.add(Task(0, "a", slot=1))
    router.add(Task(1, "b", slot=1))
    router.add(Task(2, "c"))
    router.add(Task(3, "d", slot=5))  # no worker in slot 5 (yet)
    assert _route(router, [_Worker(0), _Worker(1, busy=1)]) == [(1, 0), (0, 2)]
    assert _route(router, [_Worker(1), _Worker(5)], limit=10) == [(1, 1), (5, 3)]


def test_a_preferred_worker_is_waited_for_while_it_is_busy_or_starting_but_not_once_gone():
    router = TaskRouter()
    router.add(Task(0, "a", prefer=3))  # slot 3 % 2 == 1
    router.add(Task(1, "b", prefer=0))
    busy, starting = _Worker(1, busy=2), _Worker(0, ready=False)
    assert _route(router, [starting, busy, _Worker(2)], slot_of=lambda p: p % 2) == []
    assert _route(router, [_Worker(2)], slot_of=lambda p: p % 2) == [(2, 0), (2, 1)]


def test_requeued_tasks_go_ahead_of_later_ones_and_failures_are_counted():
    router = TaskRouter()
    router.add(Task(5, "x", slot=0))
    router.add(Task(9, "y"))
    router.requeue([Task(7, "b"), Task(2, "a")])
    assert _route(router, [_Worker(0)], limit=10) == [(0, 2), (0, 5), (0, 7), (0, 9)]
    assert [router.failed(7) for _ in range(MAX_TASK_FAILURES)] == [False] * (
        MAX_TASK_FAILURES - 1
    ) + [True]
    router.done(7)
    assert not router.failed(7)


def test_of_the_least_busy_workers_the_one_whose_results_are_held_least_takes_a_task():
    router = TaskRouter()
    for seq in range(3):
        router.add(Task(seq, seq))
    workers = [_Worker(0), _Worker(1), _Worker(2, busy=1)]
    held = {0: 2, 1: 0, 2: 0}  # worker 0's ring has two results the consumer still holds
    routed = router.route(workers, 2, held=lambda w: held[w.slot])
    assert [(w.slot, t.seq) for w, t in routed] == [(1, 0), (0, 1), (1, 2)]

"""The Iterator base class, UserFunction and PositionLog."""

import pytest

from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, function_name
from torchpipe.core.position_log import PositionLog
from torchpipe.ops.source_nodes import IndexedSourceIterator
from torchpipe.options import Options


class Counter(Iterator):
    def __init__(self, n):
        super().__init__("counter")
        self.n, self.i, self.started = n, 0, 0

    def start(self):
        self.started += 1

    def next(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def ctx(seeded=True):
    return BuildContext(seed=1, seeded=seeded, epoch=0, options=Options())


def test_lazy_start_once_and_stats():
    it = Counter(3)
    assert it.started == 0
    assert list(it) == [0, 1, 2]
    assert it.started == 1 and it.stats.produced == 3
    assert it.all_stats()[0]["stage"] == "counter"


def test_closed_iterator_raises_and_close_is_idempotent():
    it = Counter(3)
    next(it)
    it.close()
    it.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


def test_load_state_only_before_start_and_must_be_a_dict():
    it = Counter(5)
    it.load_state_dict({"i": 3})
    assert list(it) == [3, 4]
    with pytest.raises(RuntimeError, match="before the first element"):
        it.load_state_dict({"i": 0})
    with pytest.raises(ValueError, match="expected a state dict"):
        Counter(2).load_state_dict([1])
    with pytest.raises(ValueError, match="malformed"):
        Counter(2).load_state_dict({})


def test_subclass_forgetting_super_init_fails_loudly():
    class Broken(Counter):
        def __init__(self):
            self.n, self.i = 1, 0

    with pytest.raises((RuntimeError, AttributeError), match="super"):
        next(Broken())


def test_user_function_note_type_and_stop_iteration():
    def bad(x):
        raise KeyError(x)

    fn = UserFunction(bad, "map(bad)", ctx())
    with pytest.raises(KeyError) as info:
        fn.on_element(7, 3)
    assert any("map(bad)" in n and "element 7" in n for n in info.value.__notes__)

    def stops(x):
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):
        UserFunction(stops, "map(stops)", ctx()).on_element(0, 1)


def test_user_function_unpacks_plain_tuples_only():
    fn = UserFunction(lambda *a: a, "map", ctx())
    assert fn.on_element(0, (1, 2)) == (1, 2)
    assert fn.on_element(0, [1, 2]) == ([1, 2],)
    from collections import namedtuple

    P = namedtuple("P", "a b")
    assert fn.on_element(0, P(1, 2)) == (P(1, 2),)


def test_function_name():
    import functools

    assert function_name(len) == "len"
    assert function_name(functools.partial(len)) == "partial(len)"

    class Callable:
        def __call__(self, x):
            return x

    assert function_name(Callable()) == "Callable"


def test_position_log_in_order_and_out_of_order():
    log = PositionLog(IndexedSourceIterator("src", 10, lambda i: i))
    pulled = [log.pull() for _ in range(4)]
    assert [p[1] for p in pulled] == [0, 1, 2, 3]
    assert log.state() == {"input": {"index": 0}, "seq": 0, "skip": []}
    log.delivered(0)
    log.delivered(2)  # out of order
    assert log.state() == {"input": {"index": 1}, "seq": 1, "skip": [2]}
    resumed = PositionLog(IndexedSourceIterator("src", 10, lambda i: i))
    resumed.set_state(log.state())
    assert [resumed.pull()[:2] for _ in range(3)] == [(1, 1), (3, 3), (4, 4)]


def test_position_log_returns_errors_in_place():
    def get(i):
        if i == 1:
            raise ValueError("boom")
        return i

    log = PositionLog(IndexedSourceIterator("src", 3, get))
    assert log.pull()[2] is None
    seq, element, error = log.pull()
    assert seq == 1 and isinstance(error, ValueError)
    assert log.pull()[1] == 2
    with pytest.raises(StopIteration):
        log.pull()


def test_learned_is_kept_by_position_across_passes_but_not_inside_inner_datasets():
    memory = {}
    outer = BuildContext(seed=1, seeded=False, epoch=0, options=Options(), memory=memory).child(0)
    outer.learned()["executor"] = "process"
    next_pass = BuildContext(seed=2, seeded=False, epoch=1, options=Options(), memory=memory).child(
        0
    )
    assert next_pass.learned() == {"executor": "process"}
    inner = next_pass.inner(7).child(0)
    inner.learned()["executor"] = "thread"
    assert inner.learned() == {} and list(memory) == [(0,)]  # one dataset per element: nothing kept
    assert ctx().learned() == {}  # a context without memory (no Dataset behind it)

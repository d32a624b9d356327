"""What an asynchronous op took from its input and handed on (``torchpipe/core/position_log.py``):
a :class:`PositionLog`'s state is the input's position before the oldest undelivered element plus
the sequence numbers delivered after it, so a resume recomputes exactly the undelivered elements;
user errors keep their place in the order; a malformed state is a CheckpointError."""

from __future__ import annotations

import pytest

from torchpipe.core.iterator import Iterator
from torchpipe.core.position_log import PositionLog
from torchpipe.errors import CheckpointError


class _ListIterator(Iterator):
    """The items of a list; an exception among them is raised in its place."""

    def __init__(self, items):
        super().__init__("source")
        self.items, self.pos = list(items), 0

    def next(self):
        if self.pos >= len(self.items):
            raise StopIteration
        item = self.items[self.pos]
        self.pos += 1
        if isinstance(item, Exception):
            raise item
        return item

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def _log(items=range(5)):
    return PositionLog(_ListIterator(items))


def _drain(log):
    pulled = []
    while True:
        try:
            pulled.append(log.pull())
        except StopIteration:
            return pulled


def test_pull_numbers_the_input_elements_in_order():
    log = _log("abc")
    assert _drain(log) == [(0, "a", None), (1, "b", None), (2, "c", None)]


def test_a_fresh_log_is_at_the_inputs_position():
    log = _log()
    assert log.state() == {"input": {"pos": 0}, "seq": 0, "skip": []}
    fresh = _log()  # a source that was loaded or moved before the log saw it
    fresh.source.pos = 2
    assert fresh.state() == {"input": {"pos": 2}, "seq": 0, "skip": []}


def test_the_state_is_before_the_oldest_undelivered_element():
    log = _log()
    for _ in range(3):
        log.pull()
    assert log.state() == {"input": {"pos": 0}, "seq": 0, "skip": []}
    log.delivered(0)
    assert log.state() == {"input": {"pos": 1}, "seq": 1, "skip": []}
    log.delivered(1)
    log.delivered(2)
    assert log.state() == {"input": {"pos": 3}, "seq": 3, "skip": []}


def test_elements_delivered_out_of_order_are_skipped_in_the_state_until_the_oldest_is_delivered():
    log = _log()
    for _ in range(4):
        log.pull()
    log.delivered(2)
    log.delivered(1)
    assert log.state() == {"input": {"pos": 0}, "seq": 0, "skip": [1, 2]}
    log.delivered(0)
    assert log.state() == {"input": {"pos": 3}, "seq": 3, "skip": []}


def test_a_resume_recomputes_exactly_the_undelivered_elements_with_their_numbers():
    log = _log("abcdef")
    for _ in range(5):
        log.pull()
    for seq in (0, 2, 4):
        log.delivered(seq)
    state = log.state()
    assert state == {"input": {"pos": 1}, "seq": 1, "skip": [2, 4]}

    resumed = _log("abcdef")
    resumed.set_state(state)
    assert resumed.state() == state  # nothing pulled yet: the state it loaded
    assert _drain(resumed) == [(1, "b", None), (3, "d", None), (5, "f", None)]


def test_a_resumed_state_keeps_its_skips_through_another_checkpoint():
    log = _log("abcdef")
    log.set_state({"input": {"pos": 1}, "seq": 1, "skip": [2, 4]})
    assert log.pull() == (1, "b", None)
    log.delivered(1)
    state = log.state()
    assert state == {"input": {"pos": 2}, "seq": 2, "skip": [2, 4]}
    again = _log("abcdef")
    again.set_state(state)
    assert [element for _, element, _ in _drain(again)] == ["d", "f"]


def test_a_user_error_is_returned_in_its_place_and_stop_iteration_propagates():
    error = ValueError("bad element")
    log = _log(["a", error, "c"])
    assert log.pull() == (0, "a", None)
    assert log.pull() == (1, None, error)
    assert log.pull() == (2, "c", None)
    with pytest.raises(StopIteration):
        log.pull()
    for seq in range(3):
        log.delivered(seq)
    assert log.state() == {"input": {"pos": 3}, "seq": 3, "skip": []}


def test_rebase_reads_the_inputs_position_afresh():
    log = _log()
    log.pull()
    log.delivered(0)
    next(log.source)  # the op moved its input on itself, nothing in flight
    assert log.state()["input"] == {"pos": 1}
    log.rebase()
    assert log.state() == {"input": {"pos": 2}, "seq": 1, "skip": []}
    assert log.pull() == (1, 2, None)


def test_state_after_gives_the_inputs_state_right_after_an_element():
    log = _log()
    for _ in range(3):
        log.pull()
    assert log.state_after(0) == {"pos": 1}
    assert log.state_after(1) == {"pos": 2}
    assert log.state_after(2) == {"pos": 3}  # the newest: the input's latest state


def test_set_state_loads_the_inputs_state():
    log = _log()
    log.set_state({"input": {"pos": 3}, "seq": 7, "skip": []})
    assert log.source.pos == 3
    assert log.pull() == (7, 3, None)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"seq": 0, "skip": []}, r"map\(f\): state is missing \['input'\]"),
        ({"input": {"pos": 0}, "skip": []}, r"map\(f\): state is missing \['seq'\]"),
        (
            {"input": {"pos": 0}, "seq": -1, "skip": []},
            r"map\(f\): state\['seq'\] is -1, outside \[0, inf\]",
        ),
        (
            {"input": {"pos": 0}, "seq": True, "skip": []},
            r"map\(f\): state\['seq'\] must be an int",
        ),
        ({"input": {"pos": 0}, "seq": "1", "skip": []}, r"map\(f\): state\['seq'\] must be an int"),
        (
            {"input": {"pos": 0}, "seq": 0, "skip": 3},
            r"map\(f\): state\['skip'\] must be a list of sequence numbers",
        ),
        (
            {"input": {"pos": 0}, "seq": 0, "skip": [-1]},
            r"state\['skip'\] must be a list of sequence numbers",
        ),
        (
            {"input": {"pos": 0}, "seq": 0, "skip": ["1"]},
            r"state\['skip'\] must be a list of sequence numbers",
        ),
    ],
)
def test_a_malformed_state_is_a_checkpoint_error_naming_the_stage(state, message):
    log = _log()
    with pytest.raises(CheckpointError, match=message):
        log.set_state(state, "map(f)")
    assert log.source.pos == 0  # nothing loaded


def test_without_a_stage_an_error_names_the_consumer_of_the_input():
    with pytest.raises(CheckpointError, match="the consumer of source: state is missing"):
        _log().set_state({})

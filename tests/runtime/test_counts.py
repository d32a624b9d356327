"""Counts user functions keep: this process's totals, and per-thread tallies for other processes."""

import threading

from torchpipe.runtime.counts import Counts


def test_counts_add_to_this_processs_totals_from_any_thread():
    counts = Counts(("a", "b"))
    assert counts.snapshot() == {"a": 0, "b": 0}
    threads = [threading.Thread(target=lambda: [counts.add("a") for _ in range(500)])]
    threads += [threading.Thread(target=counts.add, args=("b", 7))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert counts.snapshot() == {"a": 500, "b": 7}


def test_a_snapshot_is_a_copy():
    counts = Counts(("a",))
    snapshot = counts.snapshot()
    counts.add("a")
    assert snapshot == {"a": 0} and counts.snapshot() == {"a": 1}


def test_a_tally_takes_this_threads_counts_only_within_its_block():
    counts = Counts(("a",))
    with counts.tally() as tally:
        counts.add("a", 2)
        other = threading.Thread(target=counts.add, args=("a",))  # another thread: the totals
        other.start()
        other.join(timeout=30)
        with counts.tally() as inner:  # a nested tally takes them; the outer one comes back
            counts.add("a")
        counts.add("a")
    counts.add("a", 10)
    assert tally == {"a": 3} and inner == {"a": 1}
    assert counts.snapshot() == {"a": 11}


def test_a_tally_from_elsewhere_adds_to_the_totals_new_names_too():
    counts = Counts(("a",))
    counts.add_tally({"a": 2, "b": 1})
    counts.add_tally({})
    counts.add_tally(None)
    assert counts.snapshot() == {"a": 2, "b": 1}

"""What a traced pass records (``torchpipe/observe/tracing.py``): tracks made once a key and named
uniquely, spans, counters and instants as the documented tuples on ``perf_counter``'s clock, a
bounded log that drops the oldest and says so, and the calls of a pool on a track per thread or
worker."""

from __future__ import annotations

import os
import threading
import time

from torchpipe.observe.tracing import (
    CALLS,
    CONSUMER,
    COUNTER,
    INSTANT,
    SPAN,
    STAGE,
    TraceLog,
    TraceSnapshot,
    TrackInfo,
)


def test_a_new_log_has_the_training_loops_track_and_no_events():
    before = time.perf_counter()
    log = TraceLog()
    snap = log.snapshot()
    assert before <= snap.start <= snap.end
    assert snap.tracks == {
        0: TrackInfo(0, "training loop", CONSUMER, (), os.getpid(), "waiting for data")
    }
    assert log.consumer.id == 0
    assert (
        snap.events == []
        and not snap.truncated
        and not snap.every_element
        and snap.pid == os.getpid()
    )
    assert TraceLog(every_element=True).snapshot().every_element


def test_a_track_is_made_once_a_key_and_a_taken_name_gets_a_number():
    log = TraceLog()
    a = log.track(("stage", 1), "map(f)", STAGE, (1,))
    assert log.track(("stage", 1), "another name", STAGE, (9,)) is a
    b = log.track(("stage", 2), "map(f)", STAGE, (2,))
    c = log.track(("stage", 3), "map(f)", STAGE, (3,), pid=4242, label="calls")
    assert (a.id, b.id, c.id) == (1, 2, 3)
    tracks = log.snapshot().tracks
    assert [tracks[i].name for i in (1, 2, 3)] == ["map(f)", "map(f) #2", "map(f) #3"]
    assert tracks[1] == TrackInfo(1, "map(f)", STAGE, (1,), os.getpid(), "map(f)")
    assert tracks[3].pid == 4242 and tracks[3].label == "calls"


def test_spans_counters_and_instants_are_recorded_as_documented_in_order():
    log = TraceLog()
    track = log.track("k", "batch(4)", STAGE, (0,))
    before = time.perf_counter()
    track.span(1.0, 2.5)
    track.counter(3)
    log.counter("map(f).num_parallel_calls", 8)
    log.instant(track, "retune", {"knob": 4})
    after = time.perf_counter()
    span, buffer, knob, instant = log.snapshot().events
    assert span == (SPAN, track.id, 1.0, 2.5, None, None)
    assert buffer[0] == COUNTER and buffer[1] == "batch(4) buffer" and buffer[3:] == (3, None, None)
    assert (
        knob[0] == COUNTER
        and knob[1] == "map(f).num_parallel_calls"
        and knob[3:] == (8, None, None)
    )
    assert (
        instant[:2] == (INSTANT, track.id)
        and instant[2] == instant[3]
        and instant[4:] == ("retune", {"knob": 4})
    )
    assert all(before <= e[2] <= after for e in (buffer, knob, instant))


def test_a_counter_is_named_after_its_tracks_shown_name():
    log = TraceLog()
    log.track(1, "prefetch", STAGE, ())
    second = log.track(2, "prefetch", STAGE, ())
    second.counter(1)
    assert log.snapshot().events[0][1] == "prefetch #2 buffer"


def test_a_full_log_drops_the_oldest_events_and_says_so():
    log = TraceLog(limit=3)
    for i in range(2):
        log.consumer.span(i, i + 1)
    assert not log.snapshot().truncated
    for i in range(2, 5):
        log.consumer.span(i, i + 1)
    snap = log.snapshot()
    assert snap.truncated
    assert [e[2] for e in snap.events] == [2, 3, 4]


def test_a_snapshot_is_a_copy_later_events_do_not_change():
    log = TraceLog()
    log.consumer.span(0.0, 1.0)
    snap = log.snapshot()
    log.consumer.span(1.0, 2.0)
    log.track("new", "new", STAGE, ())
    assert len(snap.events) == 1 and len(snap.tracks) == 1
    assert isinstance(snap, TraceSnapshot)


def test_a_call_on_this_thread_ends_now_on_a_track_named_after_the_thread():
    log = TraceLog()
    tracer = log.calls("map(f)", (2,))
    results = []

    def run():
        before = time.perf_counter()
        tracer.call(0.5, None, None, None)
        results.append((before, time.perf_counter()))

    thread = threading.Thread(target=run, name="map(f)-3")
    thread.start()
    thread.join()
    snap = log.snapshot()
    ((kind, track_id, t0, t1, _, _),) = snap.events
    before, after = results[0]
    assert kind == SPAN and before - 0.5 <= t0 <= after - 0.5 and abs((t1 - t0) - 0.5) < 1e-9
    assert snap.tracks[track_id] == TrackInfo(
        track_id, "map(f) on thread 3", CALLS, (2,), os.getpid(), "map(f)"
    )


def test_a_workers_calls_go_on_one_track_a_worker_at_the_times_it_gives():
    log = TraceLog()
    tracer = log.calls("map(f)", (1,))
    tracer.call(0.25, 10.0, "worker 1 (pid 77)", 77)
    tracer.call(0.5, 11.0, "worker 2 (pid 78)", 78)
    tracer.call(0.125, 12.0, "worker 1 (pid 77)", 77)
    snap = log.snapshot()
    assert [e[2:4] for e in snap.events] == [(10.0, 10.25), (11.0, 11.5), (12.0, 12.125)]
    first, second, third = (e[1] for e in snap.events)
    assert first == third != second
    assert snap.tracks[first] == TrackInfo(
        first, "map(f) on worker 1 (pid 77)", CALLS, (1,), 77, "map(f)"
    )
    assert snap.tracks[second].pid == 78


def test_two_stages_calls_on_same_named_workers_get_tracks_of_their_own():
    log = TraceLog()
    log.calls("map(f)", (1,)).call(0.1, 1.0, "worker 1", 5)
    log.calls("map(g)", (2,)).call(0.1, 1.0, "worker 1", 5)
    snap = log.snapshot()
    assert snap.events[0][1] != snap.events[1][1]
    assert {snap.tracks[e[1]].name for e in snap.events} == {
        "map(f) on worker 1",
        "map(g) on worker 1",
    }

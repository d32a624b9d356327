"""The open-files limit: results that keep coming when descriptors run short, and errors a user
can act on where the pool cannot go on (docs/process_pool.md, "Open files")."""

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from torchpipe.runtime.processes import descriptors
from torchpipe.runtime.processes.channel import Channel, DescriptorsLost
from torchpipe.runtime.processes.descriptors import (
    DescriptorBudget,
    is_open_files_error,
    open_files_error,
)
from torchpipe.runtime.processes.pool import process_executor_supported

pytestmark = pytest.mark.skipif(not process_executor_supported(), reason="needs fork and memfd")

ROOT = Path(__file__).resolve().parents[3]


def run_scenario(name):
    """A scenario of open_files_child.py, in a fresh process whose limit is 100 descriptors."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.processes.open_files_child", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("name", ["torch", "torch_persistent"])
def test_torchs_own_fd_limit_test_passes_with_torchpipes_loader(name):
    """torch's test_fd_limit_exceeded (test/test_dataloader.py), both variants, with
    tp.DataLoader: 200 batches kept under a limit of 100 descriptors. It allows a RuntimeError
    that says what to do; torchpipe holds no descriptor per batch, so it goes through."""
    assert run_scenario(name).startswith("ok kept 200")


@pytest.mark.parametrize("name", ["process_map", "interleave_processes"])
def test_a_process_map_and_process_readers_deliver_every_kept_result_under_a_low_limit(name):
    assert run_scenario(name).startswith("ok kept")


@pytest.mark.parametrize("name", ["ring_lost", "segment_lost"])
def test_at_the_limit_results_come_through_the_channel_in_order_and_descriptors_come_back(name):
    """Every descriptor taken (a ring's, then the segments' of results the loop keeps): the
    results are sent again without one, none lost or repeated, and descriptors pass again once
    there is room."""
    assert run_scenario(name).startswith("ok shortages")


def test_a_worker_that_cannot_start_raises_what_to_do():
    out = run_scenario("no_worker_at_the_limit")
    assert "limit of 100" in out and "ulimit -n" in out


def test_a_message_whose_descriptors_do_not_arrive_comes_without_them():
    """The receiver is at its limit: the message arrives, its descriptor does not, and the
    channel says so instead of handing over a short list."""
    a, b = Channel.pair()
    r, w = os.pipe()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        a.send(("segment", 7), [w])
        while True:
            try:
                spare.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        with pytest.raises(DescriptorsLost) as lost:
            b.recv()
        assert lost.value.message == ("segment", 7)
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in (r, w):
            os.close(fd)
        a.close(), b.close()


def test_without_descriptors_large_messages_travel_in_chunks():
    a, b = Channel.pair()
    a.descriptors = False
    payload = os.urandom(1_000_000)  # more than the socket's buffer: the sender waits for room

    def send():
        a.send(("bytes", 1, payload))
        a.send(("small", 2))

    sender = threading.Thread(target=send)
    sender.start()
    message, fds = b.recv()
    sender.join(10)
    assert message == ("bytes", 1, payload) and fds == []
    assert b.recv() == (("small", 2), [])
    a.close(), b.close()


def test_the_budget_allows_descriptors_again_only_with_room_and_not_more_than_once_a_second(
    monkeypatch,
):
    now = [0.0]
    budget = DescriptorBudget(clock=lambda: now[0])
    assert not budget.room_again(workers=2)  # never short: nothing to allow
    budget.ran_short()
    now[0] += 0.5
    assert not budget.room_again(workers=2)  # looked at once a second
    monkeypatch.setattr(descriptors, "open_files", lambda: descriptors.open_files_limit() - 40)
    now[0] += 1.0
    assert not budget.room_again(workers=2)  # 40 free: not the 48 two workers want
    monkeypatch.setattr(descriptors, "open_files", lambda: 10)
    now[0] += 1.0
    assert budget.room_again(workers=2) and not budget.short and budget.shortages == 1


def test_the_error_names_the_limit_and_what_to_do():
    error = open_files_error("map(decode)", "start a worker process")
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert (
        f"limit of {limit}" in str(error)
        and "ulimit -n" in str(error)
        and "map(decode)" in str(error)
    )
    assert is_open_files_error(OSError(24, "Too many open files")) and not is_open_files_error(
        OSError(2, "x")
    )

"""Preemption: a real SIGTERM to a training process, and to one of its workers.

A training process that catches SIGTERM, saves its loader's state after the current batch and
exits resumes in a new process with the rest of the epoch, exactly; one without a handler ends at
once. Either way no worker process, /dev/shm entry or memfd of its outlives it. A worker that is
sent SIGTERM on its own is a dead worker: replaced, nothing lost or repeated. The training loop
runs in tests/preemption_child.py.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import torchpipe as tp
from tests.preemption_child import CASES, ROWS, Rows, Stream, double
from tests.processes import dev_shm
from torchpipe.testing import assert_exactly_once

REPO = Path(__file__).resolve().parent.parent
TOKEN = "TORCHPIPE_PREEMPTION_TEST"
"""An environment variable each child gets a fresh value of: its forked workers inherit it, so a
scan of /proc finds every process of the run, however it started, and no other test's."""
WAIT_S = 30.0
"""The bound on every wait for a child (a loaded machine can be slow to start one)."""
DEATH_S = 10.0
"""How long a run's workers may take to die of its death (a poll of the parent's pid is the slowest way)."""
WORKERS = {"loader": True, "auto": False, "pipeline": True}
"""Whether a case has worker processes by its third batch ("auto" measures its first batches in the main process)."""


class Child:
    """A run of the training loop in tests/preemption_child.py, its stdout read as it comes.

    Args:
        case: a key of ``preemption_child.CASES``.
        state_path: where the run saves its state on SIGTERM (and resumes from, if it exists).
        token: the value of ``TOKEN`` in its environment.
        handler: install the SIGTERM handler (else SIGTERM's default action ends it).
        new_session: run it as the leader of its own process group (to signal the whole group).
    """

    def __init__(
        self,
        case: str,
        state_path: Path,
        token: str,
        handler: bool = True,
        new_session: bool = False,
    ):
        self.token = token
        env = dict(os.environ, **{TOKEN: token})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "tests.preemption_child", case, str(state_path)]
        self.stderr_path = state_path.with_suffix(f".{token[:8]}.{time.monotonic_ns()}.stderr")
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                command + ([] if handler else ["--no-handler"]),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=new_session,
            )
        self.reports: list[dict[str, Any]] = []
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def batches(self) -> list[list[int]]:
        return [r["batch"] for r in self.reports if "batch" in r]

    @property
    def pids(self) -> set[int]:
        """The run's own pid and every descendant it reported."""
        return {self.process.pid}.union(*(r["pids"] for r in self.reports if "pids" in r))

    def wait_for_batches(self, n: int) -> None:
        """Read reports until ``n`` batches have come."""
        deadline = time.monotonic() + WAIT_S
        while len(self.batches) < n:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{len(self.batches)} batches in {WAIT_S} s: {self.stderr()}"
                ) from None
            assert line is not None, (
                f"the child ended after {len(self.batches)} batches: {self.stderr()}"
            )
            self.reports.append(line)

    def finish(self) -> int:
        """Its exit code, once it ended (killed if it has not within ``WAIT_S``); reads every report."""
        try:
            code = self.process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(WAIT_S)
            raise AssertionError(
                f"the child did not end within {WAIT_S} s: {self.stderr()}"
            ) from None
        try:
            while (line := self._lines.get(timeout=WAIT_S)) is not None:
                self.reports.append(line)
        except queue.Empty:
            raise AssertionError(
                f"the child's stdout is still open {WAIT_S} s after it ended: a process of "
                f"the run holds it: {_processes_of(self.token)}"
            ) from None
        return code

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self._lines.put(json.loads(line))
            except json.JSONDecodeError:
                self._lines.put({"text": line})  # kept, so that a failure shows it
        self._lines.put(None)


@pytest.fixture
def run() -> Iterator[dict[str, Any]]:
    """A fresh token and this test's children; any child still running at the end is killed."""
    run = {"token": uuid.uuid4().hex, "children": []}
    yield run
    for child in run["children"]:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait(WAIT_S)


def _start(run: dict[str, Any], *args: Any, **kwargs: Any) -> Child:
    child = Child(*args, run["token"], **kwargs)
    run["children"].append(child)
    return child


# -- what a run can leave behind --------------------------------------------------------------


def _shm_entries(pids: set[int] | list[int] = ()) -> set[str]:
    return dev_shm({os.getpid(), *pids})


def _processes_of(token: str) -> list[int]:
    """Live processes with ``token`` in their environment (a zombie holds no memory and no fds)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(TOKEN) == token:
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _memfds_of(pids: set[int] | list[int]) -> dict[int, list[str]]:
    """The memfds each of ``pids`` holds open (shared-memory rings live in memfds)."""
    held = {}
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone (or gone while listed)
        memfds = [link for link in links if link.startswith("/memfd:")]
        if memfds:
            held[pid] = memfds
    return held


def _assert_the_scans_see(child: Child, case: str, token: str) -> None:
    """The leftover checks would see a run's processes and memfds: here, while it runs, they do."""
    running = _processes_of(token)
    assert child.process.pid in running
    if WORKERS[case]:
        assert len(running) >= 3, running  # the run, its zygote and its workers
        assert _memfds_of(running), "no process of the run holds a memfd while it runs"


def _assert_nothing_left(token: str, pids: set[int], shm_before: set[str]) -> None:
    """No process of the run lives on, none of its pids holds a memfd, /dev/shm has no new entry."""
    deadline = time.monotonic() + DEATH_S  # workers die of their parent's death: soon, not at once
    while (left := _processes_of(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [], f"processes of the run outlived it: {left}"
    assert _memfds_of(pids) == {}
    new = _shm_entries(pids) - shm_before
    if new:
        time.sleep(0.5)  # another test's entry in passing (the machine is shared) is gone by now
        new &= _shm_entries(pids)
    assert new == set(), f"new entries in /dev/shm: {sorted(new)}"


def _uninterrupted(case: str) -> list[list[int]]:
    return [batch.tolist() for batch in CASES[case]()]


# -- the training process is preempted ---------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_a_preempted_run_resumes_in_a_new_process_exactly_and_leaves_nothing(case, tmp_path, run):
    expected = _uninterrupted(case)
    shm_before = _shm_entries()
    state = tmp_path / "state.pt"
    first = _start(run, case, state)
    first.wait_for_batches(3)
    _assert_the_scans_see(first, case, run["token"])
    first.process.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.stderr()
    assert first.reports[-1] == {"saved": len(first.batches)}
    # stopped mid-epoch, so the resume has work to do
    assert 3 <= len(first.batches) < len(expected)
    second = _start(run, case, state)
    assert second.finish() == 0, second.stderr()
    assert second.reports[0] == {
        "resumed_at": len(first.batches)
    }  # the model, saved at the same batch
    assert second.reports[-1] == {"finished": len(expected)}
    assert first.batches + second.batches == expected
    _assert_nothing_left(run["token"], first.pids | second.pids, shm_before)


def test_a_sigterm_to_the_whole_process_group_also_resumes_exactly(tmp_path, run):
    """As a cluster that signals every process of the job: the zygote and the workers die of it
    (replaced if the loop still needs a batch from them) and the state saved is still exact."""
    expected = _uninterrupted("loader")
    shm_before = _shm_entries()
    state = tmp_path / "state.pt"
    first = _start(run, "loader", state, new_session=True)
    first.wait_for_batches(3)
    os.killpg(first.process.pid, signal.SIGTERM)
    assert first.finish() == 0, first.stderr()
    assert 3 <= len(first.batches) < len(expected)
    second = _start(run, "loader", state)
    assert second.finish() == 0, second.stderr()
    assert first.batches + second.batches == expected
    _assert_nothing_left(run["token"], first.pids | second.pids, shm_before)


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_without_a_handler_ends_the_run_at_once_and_leaves_nothing(case, tmp_path, run):
    shm_before = _shm_entries()
    state = tmp_path / "state.pt"
    child = _start(run, case, state, handler=False)
    child.wait_for_batches(3)
    _assert_the_scans_see(child, case, run["token"])
    child.process.send_signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM, child.stderr()
    assert not any("saved" in r or "finished" in r for r in child.reports)
    assert not state.exists()
    _assert_nothing_left(run["token"], child.pids, shm_before)


# -- a worker is sent SIGTERM on its own -------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["handler in the main process", "no handler"])
def sigterm_handler(request) -> Iterator[list[int]]:
    """A SIGTERM handler in this process where the param says, installed before the loader is
    built as a preemptible training script does: worker processes forked after it inherit it."""
    if not request.param:
        yield []
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGTERM, previous)


WORKER_CASES = {
    "map-style DataLoader, 2 workers": lambda: tp.DataLoader(Rows(), batch_size=4, num_workers=2),
    "iterable DataLoader, 2 workers": lambda: tp.DataLoader(Stream(), batch_size=4, num_workers=2),
    "map on processes": lambda: tp.range(ROWS).map(double, 2, executor="process"),
}


@pytest.mark.parametrize("name", list(WORKER_CASES))
def test_a_worker_sent_sigterm_is_replaced_and_nothing_is_lost_or_repeated(name, sigterm_handler):
    killed = assert_exactly_once(WORKER_CASES[name], seed=len(name), signal=signal.SIGTERM)
    assert killed is not None  # a worker process was signalled (and ended of it: the harness waits)
    assert sigterm_handler == []  # the signal went to the worker alone

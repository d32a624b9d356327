import os
import pickle
import signal
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch

import torchpipe as tp
from tests.disk_limits import no_room, payload  # noqa: F401 - no_room is a fixture
from tests.storage import saving_jobs
from tests.storage.test_save import ROOT, every_structure
from torchpipe.storage.saved_file import MANIFEST
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements


class Counter:
    """A map function that counts its calls (how much upstream work a pass did)."""

    def __init__(self, offset=0):
        self.calls = 0
        self.offset = offset
        self.__name__ = "counted"

    def __call__(self, x):
        self.calls += 1
        return torch.tensor([x + self.offset])


def _snapshots(root):
    return sorted(p for p in os.listdir(root) if os.path.isdir(os.path.join(root, p)))


def _published(root):
    return [s for s in _snapshots(root) if os.path.exists(os.path.join(root, s, MANIFEST))]


def test_the_first_job_writes_and_later_jobs_read(tmp_path):
    elements = every_structure()
    first = tp.from_iterable(elements).snapshot(tmp_path)
    assert_same_elements(first, elements)
    assert len(_published(tmp_path)) == 1
    count = Counter()
    # another pipeline: a new snapshot
    again = tp.from_iterable(elements).take(100).snapshot(tmp_path)
    assert_same_elements(again, elements)
    assert len(_published(tmp_path)) == 2
    same = tp.range(6).map(count).snapshot(tmp_path)
    assert [int(x) for x in same] == list(range(6)) and count.calls == 6
    count.calls = 0
    # a new Dataset object
    assert [int(x) for x in tp.range(6).map(count).snapshot(tmp_path)] == list(range(6))
    assert count.calls == 0


@pytest.mark.parametrize(
    "change", [lambda n, c: tp.range(n + 1).map(c), lambda n, c: tp.range(n).map(c).map(abs)]
)
def test_a_changed_pipeline_gets_a_new_snapshot(tmp_path, change):
    list(tp.range(4).map(Counter()).snapshot(tmp_path))
    count = Counter()
    list(change(4, count).snapshot(tmp_path))
    assert count.calls > 0 and len(_published(tmp_path)) == 2


def test_a_changed_function_gets_a_new_snapshot(tmp_path):
    list(tp.range(4).map(lambda x: x * 2).snapshot(tmp_path))
    assert list(tp.range(4).map(lambda x: x * 3).snapshot(tmp_path)) == [0, 3, 6, 9]
    assert len(_published(tmp_path)) == 2


SCALE = 2  # module globals a map function reads: changed between runs below
SCALES = [2]
SETTINGS = {"scale": 2}


class Config:
    """A plain object a map function closes over."""

    def __init__(self, scale):
        self.scale = scale


def _closure(scale):
    return lambda x: x * scale


def _default(scale):
    def times(x, scale=scale):
        return x * scale

    return times


def _closed_over_object(scale):
    config = Config(scale)
    return lambda x: x * config.scale


def _times_global(x):
    return x * SCALE


def _times_global_list(x):
    return x * SCALES[0]


def _times_global_dict(x):
    return x * SETTINGS["scale"]


CONF = types.ModuleType("conf")  # a config module the function reads: conf.scale


def _times_module_value(x):
    return x * CONF.scale


def _set_globals(monkeypatch, scale):
    """Change every global the functions above read, as an edit of this module between two jobs would."""
    monkeypatch.setattr(CONF, "scale", scale, raising=False)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", scale)
    monkeypatch.setattr(sys.modules[__name__], "SCALES", [scale])
    monkeypatch.setattr(sys.modules[__name__], "SETTINGS", {"scale": scale})


CAPTURED = {
    "closure": lambda scale: _closure(scale),
    "default argument": lambda scale: _default(scale),
    "global int": lambda scale: _times_global,
    "closed-over object": lambda scale: _closed_over_object(scale),
    "a module's value": lambda scale: _times_module_value,
}


@pytest.mark.parametrize("function", list(CAPTURED.values()), ids=list(CAPTURED))
def test_a_changed_value_the_function_reads_gets_a_new_snapshot(tmp_path, monkeypatch, function):
    _set_globals(monkeypatch, 2)
    assert list(tp.range(4).map(function(2)).snapshot(tmp_path)) == [0, 2, 4, 6]
    _set_globals(monkeypatch, 3)
    assert list(tp.range(4).map(function(3)).snapshot(tmp_path)) == [
        0,
        3,
        6,
        9,
    ]  # not the stale [0, 2, 4, 6]
    assert len(_published(tmp_path)) == 2
    assert list(tp.range(4).map(function(3)).snapshot(tmp_path)) == [
        0,
        3,
        6,
        9,
    ]  # the new one is read
    assert len(_published(tmp_path)) == 2


@pytest.mark.parametrize("function", [_times_global_list, _times_global_dict], ids=["list", "dict"])
def test_a_global_list_or_dict_is_not_in_the_fingerprint(tmp_path, monkeypatch, function):
    # as often state the function keeps (a memo, a log of calls) as data it reads: were it in the
    # fingerprint, such a function's snapshot would never be read again (docs/cache.md says so)
    _set_globals(monkeypatch, 2)
    assert list(tp.range(4).map(function).snapshot(tmp_path)) == [0, 2, 4, 6]
    _set_globals(monkeypatch, 3)
    assert list(tp.range(4).map(function).snapshot(tmp_path)) == [0, 2, 4, 6]
    assert len(_published(tmp_path)) == 1


def test_two_passes_filling_at_once_one_writes_the_other_computes(tmp_path):
    count = Counter()
    ds = tp.range(20).map(count).snapshot(tmp_path)
    a, b = iter(ds), iter(ds)
    got_a, got_b = [next(a)], [next(b)]  # both decided to fill; a holds the lock
    got_a += list(a)
    got_b += list(b)
    assert [int(x) for x in got_a] == [int(x) for x in got_b] == list(range(20))
    assert count.calls == 40 and len(_published(tmp_path)) == 1
    count.calls = 0
    assert [int(x) for x in ds] == list(range(20)) and count.calls == 0


def test_jobs_in_other_processes_compute_while_one_writes_then_read(tmp_path):
    n = 200
    child = subprocess.Popen(
        [sys.executable, "-m", saving_jobs.__name__, "snapshot", str(tmp_path), str(n), "0.01"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not any(
        n.endswith(".partial") for s in _snapshots(tmp_path) for n in os.listdir(tmp_path / s)
    ):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.02)
    saving_jobs.CALLS.clear()
    assert_same_elements(
        saving_jobs.pipeline(n).snapshot(tmp_path), [saving_jobs.make(i) for i in range(n)]
    )
    assert len(saving_jobs.CALLS) == 2 * n  # computed (the child writes), nothing written here
    assert child.wait(60) == 0, child.communicate()
    saving_jobs.CALLS.clear()
    assert_same_elements(
        saving_jobs.pipeline(n).snapshot(tmp_path), [saving_jobs.make(i) for i in range(n)]
    )
    assert len(saving_jobs.CALLS) == n  # only the expected elements above: the snapshot was read


def test_a_killed_writer_leaves_nothing_a_reader_sees_and_its_checkpoint_resumes_the_fill(tmp_path):
    n, stop, state_file = 60, 25, tmp_path / "state.pkl"
    root = tmp_path / "snap"
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            saving_jobs.__name__,
            "kill",
            str(root),
            str(n),
            "0",
            str(stop),
            str(state_file),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert _snapshots(root) and not _published(root)
    saving_jobs.CALLS.clear()
    with iter(saving_jobs.pipeline(n).snapshot(root)) as it:
        it.load_state_dict(pickle.loads(state_file.read_bytes()))
        rest = list(it)
    assert_same_elements(rest, [saving_jobs.make(i) for i in range(stop, n)])
    # the pipeline's calls, then the expected elements'
    assert len(saving_jobs.CALLS) == 2 * (n - stop)
    saving_jobs.CALLS.clear()
    assert_same_elements(
        saving_jobs.pipeline(n).snapshot(root), [saving_jobs.make(i) for i in range(n)]
    )
    assert len(saving_jobs.CALLS) == n  # read: the resumed fill published the whole pass


def test_a_fresh_pass_replaces_a_killed_writers_partial_files(tmp_path):
    root, state_file = tmp_path / "snap", tmp_path / "state.pkl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            saving_jobs.__name__,
            "kill",
            str(root),
            "30",
            "0",
            "10",
            str(state_file),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert_same_elements(
        saving_jobs.pipeline(30).snapshot(root), [saving_jobs.make(i) for i in range(30)]
    )
    (snapshot,) = _published(root)
    assert not [n for n in os.listdir(root / snapshot) if n.endswith(".partial")]


@pytest.mark.parametrize("read", [False, True])
def test_checkpoints_while_filling_and_reading(tmp_path, read):
    ds = tp.range(15).map(lambda x: torch.tensor([x])).snapshot(tmp_path).shuffle(4, seed=0)
    if read:
        list(ds)
    assert_checkpoint_roundtrip(ds, positions=[0, 1, 7, 14, 15])


def test_a_damaged_snapshot_is_written_again_with_a_warning(tmp_path):
    ds = tp.range(5).snapshot(tmp_path)
    list(ds)
    (snapshot,) = _published(tmp_path)
    (tmp_path / snapshot / MANIFEST).write_text("{not json")
    with pytest.warns(UserWarning, match="is damaged"):
        assert list(tp.range(5).snapshot(tmp_path)) == [0, 1, 2, 3, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(tp.range(5).snapshot(tmp_path)) == [0, 1, 2, 3, 4]  # written again, read now


def test_explain_cardinality_and_arguments(tmp_path):
    ds = tp.range(7).snapshot(tmp_path, compression="GZIP")
    assert ds.cardinality() == 7
    root = ds.explain().splitlines()[1]  # the first op under "Pipeline as written (root first):"
    assert root.startswith("  snapshot(path=") and "compression='GZIP'" in root
    with pytest.raises(TypeError, match="snapshot: path must be a str or os.PathLike"):
        tp.range(3).snapshot(None)
    with pytest.raises(ValueError, match="compression must be one of"):
        tp.range(3).snapshot(tmp_path, compression="LZ4")


def _snapshot(root):
    return list(tp.range(8).map(payload).snapshot(root))


def test_a_full_disk_fails_naming_the_snapshot_leaves_nothing_and_the_next_pass_writes_it(no_room):
    root = os.path.join(no_room.directory, "snapshots")
    no_room.check(no_room.run(_snapshot, root), f"snapshot({root})")
    assert [os.path.basename(name) for name in no_room.files()] == [".lock"]
    no_room.grow()
    assert _snapshot(root) == [payload(i) for i in range(8)] and _published(root)
    assert _snapshot(root) == [payload(i) for i in range(8)]

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch

import torchpipe as tp
from tests.disk_limits import no_room, payload  # noqa: F401 - no_room is a fixture
from tests.storage import saving_jobs
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.storage.saved_file import ENTRY, MANIFEST, SavedFormatError, lock_directory
from torchpipe.testing import (
    assert_elements_equal,
    assert_same_elements,
)

Point = namedtuple("Point", ["x", "y"])
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def every_structure():
    """Elements of every kind the codec knows, nested every way an element can be."""
    base = torch.arange(24.0).reshape(4, 6)
    return [
        {"bf16": torch.ones(2, 3, dtype=torch.bfloat16), "t": base.t(), "strided": base[::2, 1::3]},
        (
            torch.zeros(0, 4),
            torch.tensor(3, dtype=torch.int8),
            torch.tensor([1 + 2j]).conj().resolve_conj(),
        ),
        [np.arange(4.0).reshape(2, 2)[:, ::-1], np.float16(1.5), np.zeros((0, 2), dtype=np.uint8)],
        Point(torch.tensor(1.0, dtype=torch.float64), None),
        {
            "nested": (1, 2.5, "text", b"\x00bytes", [True, None]),
            "big": b"x" * 100_000,
            "s": "y" * 20_000,
        },
        torch.tensor([float("nan"), 1.0]),
        7,
        "a plain string",
    ]


def test_every_element_structure_round_trips_exactly(tmp_path):
    elements = every_structure()
    tp.from_iterable(elements).save(tmp_path / "s")
    loaded = tp.load(tmp_path / "s")
    assert len(loaded) == len(elements) and loaded.cardinality() == len(elements)
    assert_same_elements(loaded, elements)
    for i, element in enumerate(elements):  # random access, in any order
        assert_elements_equal(loaded[len(elements) - 1 - i], elements[len(elements) - 1 - i])


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB", "gzip"])
def test_compressed_saves_round_trip_and_are_smaller(tmp_path, compression):
    ds = tp.range(50).map(lambda i: torch.zeros(1000) + i)
    ds.save(tmp_path / "plain")
    ds.save(tmp_path / "packed", compression=compression)
    assert_same_elements(tp.load(tmp_path / "packed"), list(ds))
    size = lambda d: sum(os.path.getsize(d / n) for n in os.listdir(d))  # noqa: E731
    assert size(tmp_path / "packed") < size(tmp_path / "plain") / 5


def test_manifest_says_what_was_saved(tmp_path):
    ds = tp.range(10).map(lambda i: (torch.ones(2, i), i))
    ds.save(tmp_path / "s")
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert manifest["count"] == 10 and manifest["version"] == 1 and manifest["compression"] is None
    assert manifest["element_spec"] == {
        "kind": "tuple",
        "items": [{"kind": "tensor", "dtype": "float32", "shape": [2, None]}, {"kind": "int"}],
    }
    assert manifest["pipeline"][0].startswith("map(fn=<lambda>#") and manifest["pipeline"][
        1
    ].startswith("range(")
    assert len(manifest["shards"]) == min(usable_cpu_count(), 10)
    assert tp.load(tmp_path / "s").element_spec == manifest["element_spec"]


def test_shard_func_chooses_shards_and_load_keeps_the_order(tmp_path):
    ds = tp.range(30).map(lambda i: (i, torch.tensor([i])))
    # a tuple is unpacked, as in map
    ds.save(tmp_path / "s", shard_func=lambda i, x: (i % 3 == 0) * 4)
    shards = json.loads((tmp_path / "s" / MANIFEST).read_text())["shards"]
    assert {(s["shard"], s["records"]) for s in shards} == {(0, 20), (4, 10)}
    assert_same_elements(tp.load(tmp_path / "s"), list(ds))


def test_shard_func_errors_name_the_element(tmp_path):
    with pytest.raises(
        ValueError, match="shard_func must return an int >= 0, got -1 for element 0"
    ):
        tp.range(3).save(tmp_path / "a", shard_func=lambda i: -1)
    with pytest.raises(ZeroDivisionError) as error:
        tp.range(3).save(tmp_path / "b", shard_func=lambda i: 10 // (2 - i))
    assert "shard_func at element 2" in "\n".join(error.value.__notes__)
    with pytest.raises(FileNotFoundError, match="did not complete"):
        tp.load(tmp_path / "b")


def test_bad_arguments_fail_at_the_call(tmp_path):
    ds = tp.range(3)
    with pytest.raises(
        ValueError, match=r"compression must be one of \[None, 'GZIP', 'ZLIB'\], got 'SNAPPY'"
    ):
        ds.save(tmp_path, compression="SNAPPY")
    with pytest.raises(TypeError, match="unknown checkpoint_args \\['every'\\]"):
        ds.save(tmp_path, checkpoint_args={"every": 3})
    with pytest.raises(ValueError, match="checkpoint_interval must be an int >= 1"):
        ds.save(tmp_path, checkpoint_args={"checkpoint_interval": 0})
    with pytest.raises(TypeError, match="shard_func must be callable"):
        ds.save(tmp_path, shard_func=3)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        ds.save(3)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        tp.load(None)
    assert os.listdir(tmp_path) == []


def test_load_of_a_directory_without_a_save_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        tp.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        tp.load(tmp_path / "missing")
    (tmp_path / MANIFEST).write_text('{"format": "something else"}')
    with pytest.raises(SavedFormatError, match="not the manifest of a torchpipe saved dataset"):
        tp.load(tmp_path)


def _damage(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_record_is_a_data_loss_error_naming_file_and_offset(tmp_path):
    tp.range(4).map(lambda i: torch.full((100,), i)).save(tmp_path / "s")
    shard = sorted((tmp_path / "s").glob("shard-*-00000.records"))[0]
    _damage(shard, 100)  # inside the last record's payload
    loaded = tp.load(tmp_path / "s")
    last = 2 * ((len(loaded) - 1) // 2) if usable_cpu_count() > 1 else len(loaded) - 1
    with pytest.raises(
        tp.io.DataLossError, match=rf"{shard.name}: damaged record at byte \d+ \(element {last}\)"
    ):
        loaded[last]
    assert torch.equal(loaded[1], torch.full((100,), 1))


def _index_entries(path):
    """(element index, byte offset, framed length) of every record of a saved shard's index file."""
    data = path.read_bytes()
    return [ENTRY.unpack_from(data, at) for at in range(0, len(data), ENTRY.size)]


def test_records_swapped_on_disk_are_an_error_not_a_reorder(tmp_path):
    tp.range(6).map(lambda i: torch.full((8,), i)).save(tmp_path / "s", shard_func=lambda x: 0)
    (index,) = (tmp_path / "s").glob("shard-*-00000.index")
    records = index.with_suffix(".records")
    spans = {i: (offset, offset + length) for i, offset, length in _index_entries(index)}
    (a0, a1), (b0, b1) = spans[1], spans[2]
    assert a1 - a0 == b1 - b0 and a1 <= b0  # equal sizes: each record's checksum still holds
    data = records.read_bytes()
    records.write_bytes(data[:a0] + data[b0:b1] + data[a1:b0] + data[a0:a1] + data[b1:])
    loaded = tp.load(tmp_path / "s")
    assert torch.equal(loaded[0], torch.full((8,), 0))
    with pytest.raises(
        tp.io.DataLossError, match=rf"{records.name}: the record at byte {a0} is element 2, not 1"
    ):
        loaded[1]
    with pytest.raises(tp.io.DataLossError, match=rf"the record at byte {b0} is element 1, not 2"):
        loaded[2]
    with pytest.raises(tp.io.DataLossError, match=rf"the record at byte {a0} is element 2, not 1"):
        # iterating stops at the first swapped record, not yield it in the other's place
        list(loaded)


def test_a_damaged_or_missing_shard_fails_when_loading(tmp_path):
    tp.range(4).save(tmp_path / "s")
    index = sorted((tmp_path / "s").glob("shard-*-00000.index"))[0]
    _damage(index, ENTRY.size)
    with pytest.raises(SavedFormatError, match="is damaged"):
        tp.load(tmp_path / "s")
    for shard in (tmp_path / "s").glob("shard-*.records"):
        shard.unlink()
    with pytest.raises(SavedFormatError, match="is incomplete"):
        tp.load(tmp_path / "s")


def test_saving_again_replaces_the_saved_dataset(tmp_path):
    tp.range(3).save(tmp_path / "s")
    first = set(os.listdir(tmp_path / "s"))
    tp.range(5, 9).save(tmp_path / "s")
    assert list(tp.load(tmp_path / "s")) == [5, 6, 7, 8]
    names = set(os.listdir(tmp_path / "s"))
    assert not (names & first) - {MANIFEST, ".lock"} and "progress.pkl" not in names


def test_one_save_at_a_time(tmp_path):
    (tmp_path / "s").mkdir()
    held = lock_directory(str(tmp_path / "s"))
    try:
        with pytest.raises(RuntimeError, match="another process is saving to"):
            tp.range(3).save(tmp_path / "s")
    finally:
        held.close()
    tp.range(3).save(tmp_path / "s")


def test_an_unpicklable_element_fails_the_save_naming_it(tmp_path):
    with pytest.raises(Exception) as error:
        tp.range(5).map(lambda i: (lambda: i) if i == 3 else i).save(tmp_path / "s")
    assert "while writing element 3" in "\n".join(getattr(error.value, "__notes__", []))
    with pytest.raises(FileNotFoundError):
        tp.load(tmp_path / "s")


def test_save_after_parallel_stages_in_processes(tmp_path):
    ds = (
        tp.range(40)
        .map(lambda i: torch.full((64, 64), i), num_parallel_calls=2, executor="process")
        .batch(8)
    )
    ds.save(tmp_path / "s")
    assert_same_elements(tp.load(tmp_path / "s"), list(ds))


# -- interruption ----------------------------------------------------------------------------------
FAIL_AT = [None]


def _fragile(i):
    if i == FAIL_AT[0]:
        raise OSError("the disk went away")
    saving_jobs.CALLS.append(i)
    return torch.tensor([i])


def test_a_failed_save_resumes_from_its_last_checkpoint(tmp_path):
    ds = tp.range(100).map(_fragile)
    FAIL_AT[0] = 55
    saving_jobs.CALLS.clear()
    with pytest.raises(OSError, match="the disk went away"):
        ds.save(tmp_path / "s", checkpoint_args={"checkpoint_interval": 20})
    assert pickle.loads((tmp_path / "s" / "progress.pkl").read_bytes())["count"] == 40
    FAIL_AT[0] = None
    saving_jobs.CALLS.clear()
    ds.save(tmp_path / "s", checkpoint_args={"checkpoint_interval": 20})
    assert sorted(saving_jobs.CALLS) == list(range(40, 100))  # nothing before the checkpoint again
    assert_same_elements(tp.load(tmp_path / "s"), [torch.tensor([i]) for i in range(100)])


def test_a_changed_pipeline_does_not_resume_another_ones_save(tmp_path):
    FAIL_AT[0] = 15
    with pytest.raises(OSError):
        tp.range(30).map(_fragile).save(tmp_path / "s", checkpoint_args={"checkpoint_interval": 5})
    FAIL_AT[0] = None
    with pytest.warns(UserWarning, match="an interrupted save of another pipeline"):
        tp.range(30).map(_fragile).map(lambda x: x + 1).save(tmp_path / "s")
    assert_same_elements(tp.load(tmp_path / "s"), [torch.tensor([i + 1]) for i in range(30)])
    assert len(list((tmp_path / "s").glob("*.partial"))) == 0


def _child(kind, path, n, slow):
    return subprocess.Popen(
        [sys.executable, "-m", saving_jobs.__name__, kind, str(path), str(n), str(slow)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(condition, process, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the child ended first: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


def _progress_count(path):
    try:
        return pickle.loads((path / "progress.pkl").read_bytes())["count"]
    except (FileNotFoundError, EOFError, pickle.UnpicklingError):
        return 0


def test_a_save_killed_with_sigkill_resumes_where_it_stopped(tmp_path):
    path, n = tmp_path / "s", 300
    child = _child("save", path, n, 0.005)
    _wait_for(lambda: _progress_count(path) >= 60, child)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    assert child.returncode == -signal.SIGKILL
    with pytest.raises(FileNotFoundError, match="did not complete"):
        tp.load(path)  # a reader never sees the half-written dataset
    assert list(path.glob("shard-*.records.partial"))
    done = _progress_count(path)
    saving_jobs.CALLS.clear()
    saving_jobs.pipeline(n).save(path, checkpoint_args={"checkpoint_interval": 10})
    # only what the checkpoint did not cover
    assert sorted(saving_jobs.CALLS) == list(range(done, n))
    saving_jobs.CALLS.clear()
    assert_same_elements(tp.load(path), list(saving_jobs.pipeline(n)))
    assert not list(path.glob("*.partial")) and not (path / "progress.pkl").exists()


# -- progress bar ----------------------------------------------------------------------------------
class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_bar_on_a_terminal_and_none_elsewhere(tmp_path, monkeypatch):
    pytest.importorskip("tqdm")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    tp.range(50).save(tmp_path / "a")
    assert f"save({tmp_path / 'a'})" in terminal.getvalue() and "50/50" in terminal.getvalue()
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.range(50).save(tmp_path / "b")
    assert piped.getvalue() == ""


def _save(path, n=8):
    tp.range(n).map(payload).save(path)


def test_a_full_disk_fails_naming_the_save_keeps_the_saved_dataset_and_saving_again_succeeds(
    no_room,
):
    path = os.path.join(no_room.directory, "saved")
    _save(path, n=1)  # the dataset saved before, which a failed save must leave as it was
    before = no_room.files()
    no_room.check(no_room.run(_save, path), f"save({path})")
    assert no_room.files() == before and list(tp.load(path)) == [payload(0)]
    no_room.grow()
    _save(path)
    assert list(tp.load(path)) == [payload(i) for i in range(8)]

"""What torchpipe reads back from disk is data, never code (#56): saved datasets, snapshots, cache
files and save's checkpoint are read by the restricted unpickler; a file written by the previous
release still loads."""

import json
import os
import pickle

import pytest
import torch

import torchpipe as tp
from tests.fixtures import previous_release
from tests.safe_globals import restore_safe_globals  # noqa: F401 - an autouse fixture
from torchpipe.storage.cache_file import CacheReader
from torchpipe.storage.saved_file import MANIFEST, SavedFormatError, ShardFile
from torchpipe.testing import assert_elements_equal


class Planted:
    """An element whose pickle creates ``marker`` when it is unpickled by full pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


class Allowed:
    """A user class: loads once allowed with tp.add_safe_globals."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Allowed and other.value == self.value


def _check_refused(error, marker):
    assert not os.path.exists(marker), "the file's code ran"
    assert error.value.name == "io.open"
    message = str(error.value)
    assert "tp.add_safe_globals" in message and "trusted=True" in message


def test_a_planted_progress_file_raises_and_runs_nothing(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "data"
    path.mkdir()
    (path / "progress.pkl").write_bytes(pickle.dumps({"job": Planted(marker)}))
    with pytest.raises(tp.UntrustedTypeError) as error:
        tp.range(3).save(str(path))
    _check_refused(error, marker)
    assert "delete it to save from the start" in "".join(getattr(error.value, "__notes__", []))


def test_a_saved_record_naming_code_raises_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    tp.from_iterable([1, Planted(marker)]).save(str(tmp_path / "d"))
    ds = tp.load(str(tmp_path / "d"))
    assert ds[0] == 1
    with pytest.raises(tp.UntrustedTypeError) as error:
        ds[1]
    _check_refused(error, marker)
    with pytest.raises(tp.UntrustedTypeError):
        list(ds)


def test_a_cache_record_naming_code_raises_and_runs_nothing(tmp_path):
    marker, path = tmp_path / "ran", str(tmp_path / "cache")
    make = tp.range(2).map(lambda i: Planted(marker) if i else i)
    assert len(list(make.cache(path))) == 2  # the first pass writes the file (nothing is read)
    assert not os.path.exists(marker)
    with pytest.raises(tp.UntrustedTypeError) as error:
        list(make.cache(path))  # a new pipeline of the same fingerprint replays the file
    _check_refused(error, marker)


def test_a_planted_snapshot_raises_and_runs_nothing(tmp_path):
    marker, root = tmp_path / "ran", str(tmp_path / "snapshots")
    planted = tp.range(2).map(lambda i: Planted(marker) if i else i)
    list(planted.snapshot(root))  # as someone else's job would have written it
    with pytest.raises(tp.UntrustedTypeError) as error:
        list(planted.snapshot(root))
    _check_refused(error, marker)


def test_plain_data_round_trips_through_save_cache_and_snapshot(tmp_path):
    values = previous_release.elements()
    ds = tp.range(len(values)).map(lambda i: values[i])
    ds.save(str(tmp_path / "saved"))
    saved = tp.load(str(tmp_path / "saved"))
    cached = list(ds.cache(str(tmp_path / "cache")))
    cached_again = list(ds.cache(str(tmp_path / "cache")))
    list(ds.snapshot(str(tmp_path / "snap")))
    snapshotted = list(ds.snapshot(str(tmp_path / "snap")))
    for got in (list(saved), cached, cached_again, snapshotted):
        assert len(got) == len(values)
        for a, b in zip(got, values):
            _assert_same(a, b)


def _assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor) and want.is_sparse:
        assert torch.equal(got.to_dense(), want.to_dense())
    elif isinstance(want, torch.Tensor):
        assert got.requires_grad == want.requires_grad
        assert_elements_equal(got.detach(), want.detach())
    elif type(want).__module__ == "numpy" and want.dtype.hasobject:
        assert want.tolist() == got.tolist()
    elif isinstance(want, (tuple, list, dict)):
        items = zip(got.values(), want.values()) if isinstance(want, dict) else zip(got, want)
        assert (list(got) if isinstance(want, dict) else len(got)) == (
            list(want) if isinstance(want, dict) else len(want)
        )
        for a, b in items:
            _assert_same(a, b)
    else:
        assert_elements_equal(got, want)


def test_the_previous_release_files_still_load():
    values = previous_release.elements()
    saved = tp.load(previous_release.SAVED)
    reader = CacheReader(previous_release.CACHE)
    try:
        from_cache = [reader.next() for _ in range(reader.count)]
    finally:
        reader.close()
    for got in (list(saved), from_cache):
        assert len(got) == len(values)
        for a, b in zip(got, values):
            _assert_same(a, b)


def test_an_allowed_user_class_loads_and_trusted_loads_anything(tmp_path):
    path = str(tmp_path / "d")
    tp.from_iterable([Allowed(3)]).save(path)
    with pytest.raises(tp.UntrustedTypeError, match=r"test_untrusted\.Allowed"):
        tp.load(path)[0]
    assert tp.load(path, trusted=True)[0] == Allowed(3)
    tp.add_safe_globals([Allowed])
    assert Allowed in tp.get_safe_globals()
    assert tp.load(path)[0] == Allowed(3)
    assert list(tp.load(path).map(lambda x: x.value, num_parallel_calls=2, executor="process")) == [
        3
    ]


def test_ignore_errors_does_not_drop_a_type_to_allow(tmp_path):
    """A refused type is a setting to make, not damaged data: ignore_errors() raises it."""
    path = str(tmp_path / "d")
    tp.from_iterable([1, Allowed(3), 2]).save(path)
    with pytest.raises(tp.UntrustedTypeError, match=r"test_untrusted\.Allowed"):
        list(tp.load(path).ignore_errors())
    assert list(tp.from_iterable([1, 0, 2]).map(lambda x: 2 // x).ignore_errors()) == [
        2,
        1,
    ]  # others: dropped


def test_trusted_is_a_bool(tmp_path):
    with pytest.raises(TypeError, match="trusted"):
        tp.load(str(tmp_path), trusted="yes")
    with pytest.raises(TypeError, match="trusted"):
        tp.range(1).cache(str(tmp_path / "c"), trusted=1)
    with pytest.raises(TypeError, match="trusted"):
        tp.range(1).snapshot(str(tmp_path), trusted=None)


@pytest.mark.parametrize("name", ["../outside.records", "/etc/passwd", "sub/x.records", "..", ""])
def test_a_manifest_naming_files_outside_its_directory_is_refused(tmp_path, name):
    path = tmp_path / "d"
    tp.range(4).save(str(path))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["shards"][0]["records_file"] = name
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SavedFormatError, match="not a plain file name"):
        tp.load(str(path))


@pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW"), reason="no symlink protection on this platform")
def test_shard_files_are_never_written_through_a_planted_symlink(tmp_path):
    path, victim = tmp_path / "d", tmp_path / "victim"
    path.mkdir()
    victim.write_bytes(b"keep")
    (path / ".lock").symlink_to(victim)
    with pytest.raises(OSError):
        tp.range(4).save(str(path))
    (path / ".lock").unlink()
    for suffix in (".records.partial", ".index.partial"):
        (path / f"shard-x-00000{suffix}").symlink_to(victim)
    shard = ShardFile.create(str(path), "shard-x-00000", (0, 0, ()), ["p"])
    shard.add(0, b"payload")
    shard.finish()
    assert (
        not (path / "shard-x-00000.records").is_symlink()
        and not (path / "shard-x-00000.index").is_symlink()
    )
    assert victim.read_bytes() == b"keep"

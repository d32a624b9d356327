import copy
import gc
import os
import pathlib
import pickle
import re
import shutil
import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch

import torchpipe as tp
from tests.disk_limits import no_room, payload  # noqa: F401 - no_room is a fixture
from torchpipe.ops import cache as tp_cache
from torchpipe.ops.cache import CacheFormatError, MemoryStore
from torchpipe.testing import (
    assert_checkpoint_roundtrip,
    assert_elements_equal,
    assert_same_elements,
)

Point = namedtuple("Point", ["x", "y"])


class Counter:
    """A map function that counts its calls (how much upstream work a pass did)."""

    def __init__(self, fn=lambda x: x * 10):
        self.calls = 0
        self.fn = fn
        self.__name__ = "counted"

    def __call__(self, x):
        self.calls += 1
        return self.fn(x)


def _cached(count, path=None, fn=None, n=5):
    return tp.range(n).map(count if fn is None else fn).cache(path)


def _files(folder):
    return sorted(p.name for p in pathlib.Path(folder).iterdir())


def _pass_with_states(ds):
    """Every element of one pass, with the (pickled) state taken before it and at the end."""
    states, elements = [], []
    with iter(ds) as it:
        while True:
            states.append(pickle.dumps(it.state_dict()))
            try:
                elements.append(next(it))
            except StopIteration:
                return states, elements


def _resume(ds, state):
    with iter(ds) as it:
        it.load_state_dict(pickle.loads(state))
        return list(it)


# -- storing and replaying -------------------------------------------------------------------------
@pytest.mark.parametrize("on_disk", [False, True])
def test_second_pass_runs_nothing_upstream(tmp_path, on_disk):
    count = Counter()
    ds = _cached(count, tmp_path / "c" if on_disk else None)
    assert list(ds) == [0, 10, 20, 30, 40] and count.calls == 5
    assert list(ds) == [0, 10, 20, 30, 40] and count.calls == 5
    assert list(ds.map(lambda x: x + 1)) == [1, 11, 21, 31, 41] and count.calls == 5
    assert _files(tmp_path) == (["c"] if on_disk else [])


@pytest.mark.parametrize("on_disk", [False, True])
def test_under_repeat_runs_upstream_once(tmp_path, on_disk):
    count = Counter()
    ds = _cached(count, tmp_path / "c" if on_disk else None).repeat(3)
    # verified against tf.data 2.21: three copies, upstream called 5 times
    assert list(ds) == [0, 10, 20, 30, 40] * 3 and count.calls == 5


def test_cache_freezes_a_random_order():
    ds = tp.range(10).shuffle(10).cache().repeat(2)
    out = list(ds)
    # verified against tf.data 2.21: shuffle().cache().repeat(2) repeats one order
    assert out[:10] == out[10:] and sorted(out[:10]) == list(range(10))


@pytest.mark.parametrize("on_disk", [False, True])
def test_early_stop_leaves_no_cache(tmp_path, on_disk):
    count = Counter()
    path = tmp_path / "c" if on_disk else None
    ds = _cached(count, path)
    it = iter(ds)
    assert [next(it), next(it)] == [0, 10]
    it.close()
    assert _files(tmp_path) == []  # no file, no temporary file
    it = iter(ds)
    next(it)
    del it
    gc.collect()
    assert _files(tmp_path) == []
    calls = count.calls
    # verified against tf.data 2.21: after a partial pass the next full pass runs upstream
    assert list(ds) == [0, 10, 20, 30, 40] and count.calls == calls + 5
    assert list(ds) == [0, 10, 20, 30, 40] and count.calls == calls + 5


def test_take_downstream_does_not_complete_the_cache():
    count = Counter()
    ds = _cached(count)
    assert list(ds.take(3)) == [0, 10, 20]
    assert list(ds) == [0, 10, 20, 30, 40] and count.calls == 8


def test_file_is_read_by_a_new_dataset_object(tmp_path):
    first = Counter()
    assert list(_cached(first, str(tmp_path / "c"))) == [0, 10, 20, 30, 40]
    second = Counter()
    # a brand-new pipeline built the same way (as in a new process) reads the file
    # verified against tf.data 2.21: no upstream calls
    assert list(_cached(second, str(tmp_path / "c"))) == [0, 10, 20, 30, 40] and second.calls == 0
    assert (
        list(_cached(second, os.fsencode(tmp_path / "c"))) == [0, 10, 20, 30, 40]
        and second.calls == 0
    )


@pytest.mark.parametrize("on_disk", [False, True])
def test_concurrent_fills_the_first_to_complete_stores(tmp_path, on_disk):
    ds = tp.range(6).shuffle(6).cache(tmp_path / "c" if on_disk else None)
    a, b = iter(ds), iter(ds)
    first = [next(a)]
    second = list(b)
    first += list(a)
    assert sorted(first) == sorted(second) == list(range(6))
    assert list(ds) == second
    assert _files(tmp_path) == (["c"] if on_disk else [])


def test_pass_built_before_another_completes_replays_it():
    count = Counter()
    ds = _cached(count)
    early = iter(ds)
    early.state_dict()  # builds its iterators now
    assert list(ds) == [0, 10, 20, 30, 40]
    assert list(early) == [0, 10, 20, 30, 40] and count.calls == 5


@pytest.mark.parametrize("on_disk", [False, True])
def test_errors_are_passed_on_but_not_stored(tmp_path, on_disk):
    def fail(x):
        if x == 2:
            raise ValueError("bad 2")
        return x

    count = Counter(fail)
    ds = _cached(count, tmp_path / "c" if on_disk else None)
    it = iter(ds)
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(ValueError, match="bad 2"):
        next(it)
    assert list(it) == [3, 4]
    # verified against tf.data 2.21: the error is not cached; the replay has none
    assert list(ds) == [0, 1, 3, 4] and count.calls == 5


def test_empty_string_means_memory_like_tf(tmp_path):
    count = Counter()
    ds = _cached(count, "")
    assert list(ds) == list(ds) and count.calls == 5  # verified against tf.data 2.21
    assert "cache(path='memory')" in ds.explain()


def test_cardinality_and_explain(tmp_path):
    assert tp.range(5).cache().cardinality() == 5
    assert tp.range(5).filter(lambda x: True).cache().cardinality() == tp.UNKNOWN  # tf.data 2.21
    assert "cache(path='memory')" in tp.range(5).cache().explain()
    on_disk = tp.range(5).cache(tmp_path / "f")  # a PathLike: the files are written there
    assert (
        list(on_disk) == list(range(5))
        and _files(tmp_path)
        and all(f.startswith("f") for f in _files(tmp_path))
    )


# -- files: errors and cleanup ---------------------------------------------------------------------
def test_missing_directory_fails_at_the_call(tmp_path):
    # tf.data builds the dataset and fails at the first element; torchpipe says so at the call
    path = tmp_path / "missing" / "x" / "c"
    folder = re.escape(repr(str(tmp_path / "missing" / "x")))
    with pytest.raises(
        FileNotFoundError,
        match=rf"^cache: cannot write cache file .*/c': directory {folder} does not",
    ):
        tp.range(3).cache(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tp.range(3).cache(str(path).encode())


def test_missing_directory_fails_when_iterating_if_removed_after_the_call(tmp_path):
    (tmp_path / "gone").mkdir()
    ds = tp.range(3).cache(tmp_path / "gone" / "c")
    (tmp_path / "gone").rmdir()
    with pytest.raises(FileNotFoundError, match="gone"):
        next(iter(ds))


def test_a_file_as_the_directory_fails_at_the_call(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(
        NotADirectoryError, match=r"^cache: cannot write cache file .* is not a directory"
    ):
        tp.range(3).cache(tmp_path / "f" / "c")


def test_directory_as_path_is_an_error_at_the_call(tmp_path):
    with pytest.raises(
        IsADirectoryError, match=r"^cache: path .* is a directory; expected a file name"
    ):
        tp.range(3).cache(tmp_path)


@pytest.mark.parametrize("url", ["s3://bucket/cache", "file:///tmp/cache", "memory://c"])
def test_a_url_is_refused_at_the_call_without_touching_the_file_system(url):
    with pytest.raises(ValueError, match=r"^cache: path must be a local file name, got the URL"):
        tp.range(3).cache(url)


def test_an_unwritable_directory_fails_at_the_call_unless_a_file_is_there_to_replay(
    tmp_path, monkeypatch
):
    path = tmp_path / "c"
    assert list(tp.range(3).cache(path)) == [0, 1, 2]
    # root may write anywhere; chmod cannot show it
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    assert list(tp.range(3).cache(path)) == [0, 1, 2]  # a replay writes nothing
    with pytest.raises(
        PermissionError,
        match=r"^cache: cannot write cache file .*/d': directory .* is not writable",
    ):
        tp.range(3).cache(tmp_path / "d")


def _tensors(n=4):
    return tp.range(n).map(lambda x: torch.full((3,), x))


def _write_cache(path, n=4):
    assert list(_tensors(n).cache(path))
    return bytearray(path.read_bytes())


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[:-5], "truncated"),
        (lambda data: data[:10], "truncated"),
        (lambda data: b"NOTCACHE" + data[8:], "not a torchpipe cache"),
        (lambda data: data[:-25] + bytes([data[-25] ^ 0xFF]) + data[-24:], "checksum"),
        (lambda data: data[:-24] + b"x" * 10 + data[-24:], "corrupt"),
    ],
)
def test_corrupt_file_is_a_clear_error_naming_the_path(tmp_path, damage, message):
    path = tmp_path / "c"
    path.write_bytes(bytes(damage(_write_cache(path))))
    with pytest.raises(CacheFormatError, match=message) as info:
        list(_tensors().cache(path))
    assert str(path) in str(info.value)


def test_a_damaged_record_ends_the_pass_after_its_error(tmp_path):
    path = tmp_path / "c"
    data = _write_cache(path)
    path.write_bytes(bytes(data[:-25] + bytes([data[-25] ^ 0xFF]) + data[-24:]))  # the last record
    assert len(list(_tensors().cache(path).ignore_errors())) == 3
    (tmp_path / "missing").mkdir()
    ds = tp.range(4).cache(tmp_path / "missing" / "c")
    (tmp_path / "missing").rmdir()  # after the call, which checks it
    it = iter(ds)
    with pytest.raises(FileNotFoundError):
        next(it)
    assert next(it, "end") == "end"


def test_unpicklable_element_fails_and_stores_nothing(tmp_path):
    ds = tp.range(4).map(lambda x: (lambda: x) if x == 1 else x).cache(tmp_path / "c")
    it = iter(ds)
    assert next(it) == 0
    with pytest.raises(Exception) as info:
        next(it)
    assert any("cache(" in note for note in info.value.__notes__)
    assert list(it) == [2, 3]
    assert _files(tmp_path) == []


# -- the record encoding ---------------------------------------------------------------------------
def test_tensors_of_every_kind_survive_a_file_cache(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors
        elements = [
            {
                "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
                "t": base.t(),
                "strided": base[::2, 1::3],
            },
            {
                "empty": torch.zeros(0, 4),
                "scalar": torch.tensor(3, dtype=torch.int8),
                "conj": torch.tensor([1 + 2j]).conj(),
            },
            {
                "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 2, torch.quint8),
                "raw": b"x" * 100_000,
            },
        ]
    path = tmp_path / "c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own pickling of quantized tensors warns
        list(tp.from_iterable(elements).cache(str(path)))
        back = list(tp.from_iterable(elements).cache(str(path)))  # a new pipeline: reads the file
    assert len(back) == len(elements)
    for got, want in zip(back, elements):
        for key, value in want.items():
            if key == "quantized":
                assert torch.equal(got[key].int_repr(), value.int_repr())
            elif key == "raw":
                assert got[key] == value
            else:
                assert got[key].is_contiguous() and got[key].dtype == value.dtype
                assert torch.equal(got[key], value.resolve_conj())


def test_nested_structures_and_python_values(tmp_path):
    element = {
        "image": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
        "array": np.arange(4.0).reshape(2, 2)[:, ::-1],
        "pair": (np.int64(3), [1.5, "text", b"\x00bytes"]),
        "point": Point(torch.tensor(1.0, dtype=torch.bfloat16), None),
        "empty": (torch.zeros(0), np.zeros((0, 2), dtype=np.float16)),
    }

    def make(count):
        return tp.from_iterable([element]).map(count).cache(str(tmp_path / "c"))

    list(make(Counter(lambda x: x)))
    count = Counter(lambda x: x)
    back = list(make(count))  # a new pipeline, as in a new process: reads the file
    assert count.calls == 0 and len(back) == 1
    assert_elements_equal(back[0], element)


def test_elements_round_trip_through_a_file(tmp_path):
    make = lambda: tp.range(4).map(  # noqa: E731
        lambda x: (
            Point(torch.full((2,), x, dtype=torch.bfloat16), np.array([x])),
            {"s": str(x), "b": bytes([x])},
        )
    )
    expected = list(make())
    assert_same_elements(make().cache(tmp_path / "c"), expected)
    assert_same_elements(make().cache(tmp_path / "c"), expected)  # read back


def test_memory_store_pickles_empty():
    store = MemoryStore()
    store.offer([1, 2], (0, 0, ()))
    assert pickle.loads(pickle.dumps(store)).get() is None
    assert copy.deepcopy(store).get() is None and store.get() == ([1, 2], (0, 0, ()))


# -- checkpoints -----------------------------------------------------------------------------------
@pytest.mark.parametrize("on_disk", [False, True])
def test_checkpoint_roundtrip_filling_then_reading(tmp_path, on_disk):
    path = tmp_path / "c" if on_disk else None
    ds = tp.range(7).map(lambda x: x * 3).cache(path)
    assert_checkpoint_roundtrip(ds)  # filling pass (it completes and stores)
    assert_checkpoint_roundtrip(ds)  # reading pass
    fresh = tp.range(7).map(lambda x: x * 3).cache(tmp_path / "other" if on_disk else None)
    assert_checkpoint_roundtrip(fresh.repeat(2))  # fills in repetition 0, reads in 1
    assert_checkpoint_roundtrip(fresh.repeat(2).cache(tmp_path / "outer" if on_disk else None))


@pytest.mark.parametrize("on_disk", [False, True])
def test_checkpoint_roundtrip_with_random_ops_around(tmp_path, on_disk):
    def path(name):
        return tmp_path / name if on_disk else None

    assert_checkpoint_roundtrip(tp.range(9).shuffle(4).cache(path("a")).repeat(2))
    assert_checkpoint_roundtrip(tp.range(9).cache(path("b")).shuffle(4, seed=3).repeat(2))
    assert_checkpoint_roundtrip(tp.range(9).cache(path("c")).repeat(2).shuffle(5, seed=1))
    assert_checkpoint_roundtrip(
        tp.range(9).map(lambda x: x, num_parallel_calls=2).cache(path("d")).batch(2)
    )
    assert_checkpoint_roundtrip(
        tp.range(9).map(lambda x: -x).cache(path("e")).prefetch(2).repeat(2)
    )


@pytest.mark.parametrize("on_disk", [False, True])
def test_resuming_a_replay_without_the_stored_elements_rebuilds_the_fill(tmp_path, on_disk):
    path = tmp_path / "c" if on_disk else None
    make = lambda count: tp.range(8).map(count).shuffle(8).cache(path).repeat(2)  # noqa: E731
    states, elements = _pass_with_states(make(Counter()))
    if on_disk:
        os.remove(path)
    for k in [
        9,
        12,
        15,
    ]:  # inside the replaying repetition (at 16 a prefetch may hold the end state)
        count = Counter()
        # a new Dataset object has an empty store, as in a new process
        assert _resume(make(count), states[k]) == elements[k:]
        assert count.calls == 8
        if on_disk:
            assert _files(tmp_path) == ["c"]  # the rebuilt pass stored its elements
            os.remove(path)


def test_resumed_memory_fill_runs_upstream_but_stores_nothing():
    count = Counter()
    ds = _cached(count)
    states, elements = _pass_with_states(tp.range(5).map(Counter()).cache())
    assert _resume(ds, states[2]) == elements[2:]
    assert count.calls == 3
    assert list(ds) == elements and count.calls == 8  # nothing was stored: this pass fills


def test_resumed_file_fill_continues_the_temporary_file(tmp_path):
    path = tmp_path / "c"
    double = lambda x: x * 2  # noqa: E731
    ds = tp.range(6).map(Counter(double)).cache(path)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.state_dict()
    (temp,) = _files(tmp_path)
    shutil.copy(tmp_path / temp, tmp_path / "saved")
    next(it)  # written past the checkpoint; the resume must truncate it
    it.close()
    os.replace(tmp_path / "saved", tmp_path / temp)  # as if the process had been killed
    with iter(tp.range(6).map(Counter(double)).cache(path)) as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == [6, 8, 10]
    assert _files(tmp_path) == ["c"]
    count = Counter(double)
    assert list(tp.range(6).map(count).cache(path)) == [0, 2, 4, 6, 8, 10] and count.calls == 0


def test_resumed_file_fill_without_its_temporary_file_stores_nothing(tmp_path):
    path = tmp_path / "c"
    states, elements = _pass_with_states(tp.range(6).cache(path))
    os.remove(path)
    assert _resume(tp.range(6).cache(path), states[3]) == elements[3:]
    assert _files(tmp_path) == []


def test_state_of_a_finished_pass_resumes_to_the_end(tmp_path):
    for ds in [tp.range(3).cache(), tp.range(3).cache(tmp_path / "c")]:
        states, _ = _pass_with_states(ds)  # fills
        assert _resume(ds, states[-1]) == []
        states, _ = _pass_with_states(ds)  # reads
        assert _resume(ds, states[-1]) == []


def test_malformed_state_is_a_checkpoint_error():
    it = iter(tp.range(3).cache())
    state = it.state_dict()
    state["pipeline"] = {"mode": "sideways"}
    with pytest.raises(ValueError, match="malformed|missing"):
        iter(tp.range(3).cache()).load_state_dict(state)


def test_cached_elements_own_their_memory():
    from torchpipe.ops.cache import owned

    base = np.arange(10.0)
    element = {"view": torch.from_numpy(base), "array": base[2:], "own": torch.ones(2), "n": 3}
    copy = owned(element)
    assert copy["view"].untyped_storage().resizable() and copy["array"].flags.owndata
    assert copy["own"] is element["own"] and copy["n"] == 3
    assert_elements_equal(copy, element)
    plain = (torch.ones(1), "s")
    assert owned(plain) is plain
    # a cache after worker processes keeps copies, not views pinning the workers' shared memory
    ds = tp.range(6).map(lambda x: torch.full((1000,), float(x)), 2, executor="process").cache()
    first = list(ds)
    assert [float(t[0]) for t in ds] == [float(t[0]) for t in first] == [float(x) for x in range(6)]


# -- what a file is bound to: its records' places, its pipeline, its format ------------------------
def _record_spans(data):
    """(start, end) of every record of a cache file's bytes."""
    import struct

    meta_length = struct.unpack_from("<I", data, 12)[0]
    offset, spans = 16 + meta_length, []
    while offset < len(data) - 24:
        length = struct.unpack_from("<Q", data, offset)[0]
        spans.append((offset, offset + 20 + length))
        offset += 20 + length
    return spans


def test_records_swapped_on_disk_are_an_error_not_a_reorder(tmp_path):
    path = tmp_path / "c"
    data = _write_cache(path)
    (a0, a1), (b0, b1) = _record_spans(data)[1:3]
    assert a1 - a0 == b1 - b0  # equal sizes: the footer still adds up, each checksum still holds
    path.write_bytes(bytes(data[:a0] + data[b0:b1] + data[a0:a1] + data[b1:]))
    it = iter(_tensors().cache(path))
    assert next(it).tolist() == [0, 0, 0]
    with pytest.raises(CacheFormatError, match="record 2 is where record 1 belongs"):
        next(it)


def test_a_changed_function_above_the_cache_rebuilds_the_file(tmp_path):
    path = tmp_path / "c"
    assert list(tp.range(4).map(lambda x: x * 2).cache(path)) == [0, 2, 4, 6]
    count = Counter(lambda x: x * 3)
    with pytest.warns(
        tp_cache.StaleCacheWarning,
        match=r"another pipeline above the cache: op 0 was map\(fn=<lambda>#",
    ):
        assert list(tp.range(4).map(count).cache(path)) == [0, 3, 6, 9]
    assert count.calls == 4 and _files(tmp_path) == ["c"]
    again = Counter(lambda x: x * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(tp.range(4).map(again).cache(path)) == [0, 3, 6, 9]  # the rebuilt file replays
    assert again.calls == 0


def _scaled(path, factor):
    return tp.range(3).map(lambda x: x * factor).cache(path)


@pytest.mark.parametrize("factor, rebuilt", [(2, False), (3, True)])
def test_a_value_a_function_closes_over_is_part_of_the_fingerprint(tmp_path, factor, rebuilt):
    path = tmp_path / "c"
    list(_scaled(path, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(_scaled(path, factor)) == [0, factor, 2 * factor]
    assert [w.category for w in caught] == ([tp_cache.StaleCacheWarning] if rebuilt else [])


def test_a_file_of_an_older_format_is_rebuilt_with_a_warning(tmp_path):
    path = tmp_path / "c"
    data = _write_cache(path)
    data[8:12] = (2).to_bytes(4, "little")  # as an older torchpipe wrote it
    path.write_bytes(bytes(data))
    count = Counter(lambda x: torch.full((3,), x))
    with pytest.warns(
        tp_cache.StaleCacheWarning, match="format version 2, from an older torchpipe"
    ):
        assert len(list(tp.range(4).map(count).cache(path))) == 4
    assert count.calls == 4 and path.read_bytes()[8:12] == (3).to_bytes(4, "little")


def test_temporary_files_of_killed_passes_are_removed_once_a_file_is_complete(tmp_path):
    path = tmp_path / "c"
    leftover = tmp_path / "c.tmp-4242-deadbeef"
    leftover.write_bytes(b"a killed pass's partial file")
    ds = tp.range(5).cache(path)
    live = iter(ds)
    next(live)  # a pass filling right now: its temporary file is locked and stays
    assert len(_files(tmp_path)) == 2
    assert list(ds) == [0, 1, 2, 3, 4]  # publishes the file
    assert _files(tmp_path) == [
        "c",
        next(n for n in _files(tmp_path) if n.startswith("c.tmp-") and "4242" not in n),
    ]
    live.close()
    assert _files(tmp_path) == ["c"]
    leftover.write_bytes(b"another one")
    assert list(ds) == [0, 1, 2, 3, 4]  # a replay of the complete file cleans up too
    assert _files(tmp_path) == ["c"]


def _fill(path):
    return list(tp.range(8).map(payload).cache(path))


def test_a_full_disk_fails_naming_the_file_leaves_nothing_and_the_next_pass_fills(no_room):
    path = os.path.join(no_room.directory, "c")
    no_room.check(no_room.run(_fill, path), f"cache({path})")
    assert no_room.files() == []
    no_room.grow()
    assert _fill(path) == _fill(path) and no_room.files() == ["c"]


def _fill_in_a_worker(path):
    return list(
        torch.utils.data.DataLoader(
            tp.range(8).map(payload).cache(path), batch_size=None, num_workers=1
        )
    )


def test_a_full_disk_in_a_torch_dataloader_worker_reaches_the_caller_naming_the_file(no_room):
    # torch re-raises a worker's exception as its type built from its text: the errno is read back from it.
    path = os.path.join(no_room.directory, "c")
    error = no_room.run(_fill_in_a_worker, path)
    assert isinstance(error, tp.DiskFullError) and error.errno == no_room.errno, repr(error)
    assert f"cache({path}): " in str(error) and " bytes to " in str(error)
    assert no_room.files() == []

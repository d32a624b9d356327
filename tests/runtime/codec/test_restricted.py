"""The restricted unpickler (#56): what it rebuilds, what it refuses, and that refusing runs nothing."""

import collections
import io
import pickle
import sys
import typing

import numpy as np
import pytest
import torch

import torchpipe as tp
from tests.safe_globals import restore_safe_globals  # noqa: F401 - an autouse fixture
from torchpipe.runtime import codec
from torchpipe.runtime.codec import restricted

Plain = collections.namedtuple("Plain", ["a", "b"], defaults=[0])


class Typed(typing.NamedTuple):
    """A typing.NamedTuple with a docstring, annotations and a default."""

    x: int
    y: float = 1.0


class Slotted(Plain):
    __slots__ = ()


class WithMethod(Plain):
    def __hash__(self):
        raise AssertionError("unpickling ran the class's code")


def _restricted_round_trip(value):
    return codec.decode_bytes(codec.encode_bytes(value), restricted=True)


@pytest.mark.parametrize(
    "value", [Plain(1), Typed(2), Slotted(3, 4), {Plain(1, 2): [Typed(1, 2.5)]}]
)
def test_plain_namedtuples_are_rebuilt_without_being_allowed(value):
    out = _restricted_round_trip(value)
    assert out == value and type(out) is type(value)


def test_a_namedtuple_with_methods_of_its_own_must_be_allowed():
    with pytest.raises(tp.UntrustedTypeError, match="WithMethod"):
        _restricted_round_trip([WithMethod(1, 2)])
    tp.add_safe_globals([WithMethod])
    assert restricted.find_safe_global(__name__, "WithMethod") is WithMethod


def test_a_module_not_imported_is_never_imported(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "planted_module_56.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nimport collections\nP = collections.namedtuple('P', 'x')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = b"cplanted_module_56\nP\n(I1\ntR."  # P(1), naming the module (protocol 0)
    with pytest.raises(tp.UntrustedTypeError, match="planted_module_56.P"):
        restricted.loads(data)
    with pytest.raises(tp.UntrustedTypeError, match="planted_module_56"):
        restricted.find_safe_global("planted_module_56", "P")
    assert not marker.exists() and "planted_module_56" not in sys.modules


def test_a_tensor_storage_is_read_with_torchs_restricted_unpickler(tmp_path):
    marker = tmp_path / "ran"

    class Storage:
        def __reduce__(self):
            buffer = io.BytesIO()
            torch.save(_Planted(marker), buffer, _use_new_zipfile_serialization=False)
            return torch.storage._load_from_bytes, (buffer.getvalue(),)

    with pytest.raises(pickle.UnpicklingError):
        restricted.loads(pickle.dumps(Storage()))
    assert not marker.exists()


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_sparse_indices_are_checked_against_the_size():
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (2,), check_invariants=False
    )
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        restricted.loads(pickle.dumps(bad))
    good = torch.tensor([[0, 1], [1, 0]]).to_sparse()
    assert torch.equal(restricted.loads(pickle.dumps(good)).to_dense(), good.to_dense())


def test_a_raw_buffer_is_never_an_object_array():
    record = codec.encode_bytes(np.zeros(2, dtype=np.int64))
    forged = bytes(record).replace(b"<i8", b"|O8")  # the dtype token of the raw buffer's array
    assert forged != record
    with pytest.raises(ValueError, match="dtype object"):
        codec.decode_bytes(forged, restricted=True)


def test_the_allow_list_travels_with_a_pickled_reader():
    tp.add_safe_globals([WithMethod])
    carried = pickle.dumps(restricted.SafeGlobals())
    tp.clear_safe_globals()
    assert tp.get_safe_globals() == []
    pickle.loads(carried)
    assert tp.get_safe_globals() == [WithMethod]


def test_add_safe_globals_takes_classes_and_functions_pickle_can_name():
    def local():
        pass

    with pytest.raises(TypeError, match="expected classes or functions"):
        tp.add_safe_globals(["collections.OrderedDict"])
    with pytest.raises(TypeError, match="inside a function"):
        tp.add_safe_globals([local])

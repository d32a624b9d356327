import functools
import mmap
import pickle
import struct
import threading
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

from tests.runtime.codec.alignment import aligned_base, data_addresses, misaligned
from torchpipe.runtime import codec
from torchpipe.runtime.codec import pickling as codec_pickle
from torchpipe.testing import assert_elements_equal

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental",
    "ignore:.*quantize_per_tensor",
    "ignore:TypedStorage is deprecated",
)

Point = namedtuple("Point", "x y")

SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
QUANTIZED = ("torch.qint", "torch.quint")
TORCH_DTYPES = sorted(
    {
        v
        for v in vars(torch).values()
        if isinstance(v, torch.dtype) and not str(v).startswith(QUANTIZED)
    },
    key=str,
)


class Blob:
    """Holds its payload as an out-of-band pickle buffer, like zero-copy pickling libraries do."""

    def __init__(self, payload):
        self.payload = payload

    def __reduce_ex__(self, protocol):
        return Blob, (pickle.PickleBuffer(self.payload),)


class HoldsArray:
    def __init__(self, array, note):
        self.array = array
        self.note = note


class FreshState:
    """Pickles as an object made on the spot (its state), which pickle drops once it is written."""

    def __init__(self, make):
        self.make = make

    def __reduce__(self):
        return FreshState, (None,), self.make()

    def __setstate__(self, state):
        self.state = state


class HoldsLock:
    def __init__(self):
        self.lock = threading.Lock()


def roundtrip(element, allocate=None):
    """Encode into the middle of a larger buffer, decode, then scribble over the buffer."""
    encoded = codec.encode(element)
    arena = bytearray(b"\xee" * (encoded.nbytes + 256))
    encoded.write_into(memoryview(arena)[128 : 128 + encoded.nbytes])
    assert arena[:128] == b"\xee" * 128 and arena[128 + encoded.nbytes :] == b"\xee" * 128
    out = codec.decode(memoryview(arena)[128 : 128 + encoded.nbytes], allocate=allocate)
    arena[:] = b"\xab" * len(arena)  # nothing decoded may still view the buffer
    return out


def random_tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def tensor_bytes(t):
    """The tensor's bytes in C order, read through a same-size integer view (a bit copy)."""
    t = t.detach()
    if t.is_complex() and t.element_size() not in SAME_SIZE_INT:
        t = torch.view_as_real(t)
    return bytes(
        t.view(SAME_SIZE_INT[t.element_size()]).contiguous().reshape(-1).view(torch.uint8).numpy()
    )


TENSOR_LAYOUTS = {
    "contiguous": lambda dt: random_tensor(dt, (3, 4)),
    "transposed": lambda dt: random_tensor(dt, (4, 3)).t(),
    "stepped": lambda dt: random_tensor(dt, (6, 8))[::2, 1::3],
    "expanded": lambda dt: random_tensor(dt, (1, 4)).expand(3, 4),
    "scalar": lambda dt: random_tensor(dt, ()),
    "empty": lambda dt: random_tensor(dt, (0, 3)),
}


@pytest.mark.parametrize("layout", sorted(TENSOR_LAYOUTS))
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_and_layout_round_trips_bit_exactly(dtype, layout):
    t = TENSOR_LAYOUTS[layout](dtype)
    out = roundtrip({"t": t})["t"]
    assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == t.shape
    assert out.is_contiguous() and not out.requires_grad
    assert tensor_bytes(out) == tensor_bytes(t)


def test_nan_payloads_survive_bit_for_bit():
    bits = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC0BEEF, 0x7FBFFFFF], dtype=torch.int64).to(
        torch.int32
    )
    f32 = bits.view(torch.float32)
    halves = (
        torch.tensor([0x7E01, 0x7C01, 0xFE55], dtype=torch.int32)
        .to(torch.int16)
        .view(torch.float16)
    )
    arr = np.array([0x7FF0000000000001, 0x7FF8DEADBEEF0001], dtype=np.int64).view(np.float64)
    out = roundtrip((f32, f32[::2], halves, arr, arr[::-1]))
    assert out[0].view(torch.int32).tolist() == bits.tolist()
    assert out[1].view(torch.int32).tolist() == bits[::2].tolist()
    assert tensor_bytes(out[2]) == tensor_bytes(halves)
    assert out[3].tobytes() == arr.tobytes() and out[4].tobytes() == array_bytes(arr[::-1])


def structured_dtype():
    return np.dtype([("a", "u1"), ("b", "<f8"), ("c", "<i2", (2,))], align=True)


NUMPY_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
    np.clongdouble,
    "datetime64[ns]",
    "timedelta64[s]",
    "S5",
    "U3",
    "V8",
    ">i4",
    ">f8",
    structured_dtype(),
]


def random_array(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "U":
        codes = rng.integers(0, 0x110000, n * dtype.itemsize // 4, dtype=np.uint32)
        return codes.view(dtype).reshape(shape)
    if dtype.names is not None:
        out = np.zeros(shape, dtype)
        out["a"], out["b"] = rng.integers(0, 255, shape), rng.standard_normal(shape)
        out["c"] = rng.integers(-99, 99, shape + (2,))
        return out
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).reshape(shape)


ARRAY_LAYOUTS = {
    "contiguous": lambda dt: random_array(dt, (3, 4)),
    "transposed": lambda dt: random_array(dt, (4, 3)).T,
    "fortran": lambda dt: np.asfortranarray(random_array(dt, (3, 4))),
    "negative_strides": lambda dt: random_array(dt, (6, 8))[::-1, ::-3],
    "broadcast": lambda dt: np.broadcast_to(random_array(dt, (1, 4)), (3, 4)),
    "scalar": lambda dt: random_array(dt, ()),
    "empty": lambda dt: random_array(dt, (0, 3)),
}


@pytest.mark.parametrize("layout", sorted(ARRAY_LAYOUTS))
@pytest.mark.parametrize(
    "dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).str + ("s" if np.dtype(d).names else "")
)
def test_every_numpy_dtype_and_layout_round_trips_bit_exactly(dtype, layout):
    a = ARRAY_LAYOUTS[layout](dtype)
    out = roundtrip([a])[0]
    assert type(out) is np.ndarray and out.dtype == a.dtype and out.dtype.str == a.dtype.str
    assert out.shape == a.shape and out.flags.c_contiguous and out.flags.writeable
    assert out.tobytes() == array_bytes(a)


def array_bytes(a):
    """The array's bytes in C order, each element copied whole (structured padding included)."""
    return np.ascontiguousarray(a.view(np.dtype((np.void, a.itemsize)))).tobytes()


def test_object_arrays_and_array_subclasses_are_pickled():
    objects = np.array([1, "two", None, [3]], dtype=object)
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    out = roundtrip({"objects": objects, "masked": masked})
    assert out["objects"].dtype == object and out["objects"].tolist() == objects.tolist()
    assert type(out["masked"]) is np.ma.MaskedArray and out["masked"].mask.tolist() == [
        False,
        True,
        False,
    ]


def test_high_rank_and_large_tensors_and_arrays():
    deep = random_tensor(torch.float32, (1, 2) * 10)
    big = random_tensor(torch.float32, (2048, 2048))  # 16 MiB: the GIL-free copy path
    wide = random_array(np.int16, (4096, 1024))
    out = roundtrip((deep, big, big.t(), wide, wide[:, ::2]))
    assert_elements_equal(
        out, (deep, big, big.t().contiguous(), wide, np.ascontiguousarray(wide[:, ::2]))
    )


def test_requires_grad_is_kept_on_detached_data():
    leaf = torch.randn(3, requires_grad=True)
    derived = leaf * 2
    out = roundtrip({"leaf": leaf, "derived": derived, "plain": torch.ones(2)})
    for key, original in (("leaf", leaf), ("derived", derived)):
        assert out[key].requires_grad and out[key].is_leaf and out[key].grad_fn is None
        assert torch.equal(out[key].detach(), original.detach())
    assert not out["plain"].requires_grad


def test_lazy_conjugate_and_negative_views_are_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    neg = torch._neg_view(torch.randn(3))
    out = roundtrip((z.conj(), z.conj()[::2], z.conj().imag, neg))
    assert_elements_equal(
        out, (z.conj().resolve_conj(), z.conj()[::2].resolve_conj(), -z.imag, neg.resolve_neg())
    )
    assert not out[0].is_conj() and not out[2].is_neg()


def test_nested_structures_keep_types_order_and_values():
    element = {
        "z": Point(torch.arange(3), [None, "text", b"bytes", bytearray(b"ba")]),
        "a": (2**200, -(2**70), 1.5, float("nan"), True, 3 + 4j),
        "m": OrderedDict([("k2", np.arange(2)), ("k1", {"deep": [[torch.tensor(7)]]})]),
        "empty": ((), [], {}),
    }
    out = roundtrip(element)
    assert list(out) == ["z", "a", "m", "empty"] and list(out["m"]) == ["k2", "k1"]
    assert type(out["z"]) is Point and type(out["m"]) is OrderedDict
    assert_elements_equal(out, element)


def test_the_same_tensor_twice_is_stored_once_and_stays_one_object():
    t, a = torch.randn(100), np.arange(100)
    once = codec.encode({"t": t, "a": a})
    twice = codec.encode({"t": t, "t2": t, "a": a, "a2": a})
    assert twice.nbytes - once.nbytes < 64
    out = roundtrip({"t": t, "t2": t, "a": a, "a2": a})
    assert out["t"] is out["t2"] and out["a"] is out["a2"]


def test_objects_holding_arrays_and_out_of_band_buffers():
    holder = HoldsArray(np.arange(6.0).reshape(2, 3).T, note="n")
    out = roundtrip([holder, Blob(bytearray(b"writable" * 100)), Blob(b"read-only" * 100)])
    assert type(out[0]) is HoldsArray and out[0].note == "n"
    assert_elements_equal(out[0].array, np.ascontiguousarray(holder.array))
    assert type(out[1].payload) is bytearray and out[1].payload == bytearray(b"writable" * 100)
    assert type(out[2].payload) is bytes and out[2].payload == b"read-only" * 100


def test_non_plain_tensors_fall_back_to_pickle():
    sparse = torch.randn(4, 5).relu().to_sparse()
    quantized = torch.quantize_per_tensor(torch.randn(6), 0.1, 3, torch.qint8)
    meta = torch.empty(2, 3, device="meta")
    param = torch.nn.Parameter(torch.randn(3))
    out = roundtrip((sparse, quantized, meta, param))
    assert out[0].layout == torch.sparse_coo and torch.equal(out[0].to_dense(), sparse.to_dense())
    assert out[1].is_quantized and torch.equal(out[1].int_repr(), quantized.int_repr())
    assert out[1].q_scale() == quantized.q_scale() and out[1].q_zero_point() == 3
    assert out[2].is_meta and out[2].shape == (2, 3)
    assert (
        type(out[3]) is torch.nn.Parameter
        and out[3].requires_grad
        and torch.equal(out[3].data, param.data)
    )


def test_allocate_hook_receives_every_tensor():
    calls = []

    def allocate(shape, dtype):
        t = torch.full(shape, 1, dtype=dtype)  # not empty: every byte must be overwritten
        calls.append(t)
        return t

    sparse = torch.randn(3, 3).relu().to_sparse()  # its indices and values are plain tensors
    element = {
        "a": torch.randn(2, 3),
        "b": [torch.arange(4).t(), torch.zeros(0)],
        "s": sparse,
        "n": np.ones(2),
    }
    out = roundtrip(element, allocate=allocate)
    assert len(calls) == 5
    assert out["a"] is calls[0] and out["b"][0] is calls[1] and out["b"][1] is calls[2]
    assert_elements_equal(
        {k: v for k, v in out.items() if k != "s"}, {k: v for k, v in element.items() if k != "s"}
    )
    assert torch.equal(out["s"].to_dense(), sparse.to_dense())


def test_allocate_hook_must_return_the_asked_shape_and_dtype():
    record = codec.encode_bytes(torch.ones(2, 3))
    with pytest.raises(TypeError, match="allocate"):
        codec.decode(record, allocate=lambda shape, dtype: torch.empty(3, 2, dtype=dtype))
    with pytest.raises(TypeError, match="not contiguous"):
        codec.decode(record, allocate=lambda shape, dtype: torch.empty(3, 2, dtype=dtype).t())
    with pytest.raises(TypeError, match="on meta"):
        codec.decode(
            record, allocate=lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")
        )


def test_decode_uses_the_allocator_for_every_tensor():
    shapes = []
    encoded = codec.encode((torch.ones(5), "x", torch.zeros(2, 2)))
    buf = bytearray(encoded.nbytes)
    encoded.write_into(memoryview(buf))
    out = codec.decode(
        memoryview(buf),
        allocate=lambda shape, dtype: shapes.append(shape) or torch.empty(shape, dtype=dtype),
    )
    assert_elements_equal(out, (torch.ones(5), "x", torch.zeros(2, 2)))
    assert shapes == [(5,), (2, 2)]


def test_write_into_an_mmap_slice_at_an_offset():
    element = {"x": torch.randn(64, 65).t(), "y": "label", "z": np.arange(1000)}
    encoded = codec.encode(element)
    with mmap.mmap(-1, 4096 + encoded.nbytes + 100) as region:
        view = memoryview(region)
        encoded.write_into(view[4096:])
        out = codec.decode(view[4096 : 4096 + encoded.nbytes])
        view.release()
    assert_elements_equal(out, {"x": element["x"].contiguous(), "y": "label", "z": element["z"]})


def test_no_view_of_an_mmap_survives_errors():
    encoded = codec.encode({"x": torch.ones(4), "y": torch.ones(2, 3).t()})
    region = mmap.mmap(-1, encoded.nbytes)
    encoded.write_into(region)

    def allocate(shape, dtype):
        raise RuntimeError("out of pinned memory")

    with pytest.raises(RuntimeError, match="out of pinned memory") as decode_error:
        codec.decode(region, allocate=allocate)
    with pytest.raises(ValueError, match="bytes") as write_error:
        codec.encode(torch.ones(1000)).write_into(region)
    region.close()  # BufferError if a view kept alive by either traceback still exported it
    assert (
        decode_error.value.__traceback__ is not None and write_error.value.__traceback__ is not None
    )


def test_record_layout_matches_the_documented_format():
    element = (torch.arange(3, dtype=torch.int16), Blob(b"abc"), np.zeros(5, np.uint8))
    record = codec.encode_bytes(element)
    magic, version, _, count, _, skeleton_len, total = struct.unpack_from("<4sHHIIQQ", record)
    assert (magic, version, count, total) == (b"TPEC", 2, 3, len(record))
    table = struct.unpack_from(f"<{2 * count}Q", record, 32)
    assert list(table[0::2]) == [6, 3, 5] and list(table[1::2]) == [0, 1 | 2, 0]
    offset = 32 + 16 * count + skeleton_len
    offsets = []
    for length in table[0::2]:
        offset = -(-offset // 64) * 64
        offsets.append(offset)
        offset += length
    assert offset == total
    assert (
        record[offsets[0] : offsets[0] + 6] == torch.arange(3, dtype=torch.int16).numpy().tobytes()
    )
    assert record[offsets[1] : offsets[1] + 3] == b"abc"
    assert_elements_equal(codec.decode_bytes(record)[2], element[2])


def test_version_1_records_still_decode():
    # Cache files hold records of version 1, which are version 2 records without its new kinds.
    element = {"t": torch.arange(5), "a": np.ones(3), "s": "x", "b": b"z" * 100_000}
    record = bytearray(codec.encode_bytes(element))
    struct.pack_into("<H", record, 4, 1)
    assert_elements_equal(codec.decode(record), element)


def test_write_into_rejects_small_or_read_only_buffers():
    encoded = codec.encode(torch.zeros(10))
    with pytest.raises(ValueError, match=f"{encoded.nbytes} bytes"):
        encoded.write_into(memoryview(bytearray(encoded.nbytes - 1)))
    with pytest.raises(ValueError, match="read-only"):
        encoded.write_into(memoryview(bytes(encoded.nbytes)))


def test_decode_accepts_bytes_bytearray_and_longer_buffers():
    record = codec.encode_bytes([torch.arange(5), "s"])
    for buf in (record, bytearray(record), memoryview(record + b"\0" * 100)):
        assert_elements_equal(codec.decode(buf), [torch.arange(5), "s"])


def test_corrupt_or_truncated_records_raise_value_error():
    record = bytearray(codec.encode_bytes({"x": torch.arange(100), "y": "text" * 50}))
    for cut in (0, 10, 31, 40, len(record) // 2, len(record) - 1):
        with pytest.raises(ValueError, match="truncated"):
            codec.decode(memoryview(record)[:cut])
    with pytest.raises(ValueError, match="magic"):
        codec.decode(b"XXXX" + record[4:])
    with pytest.raises(ValueError, match="version 9"):
        codec.decode(record[:4] + struct.pack("<H", 9) + record[6:])
    wrong_length = bytearray(record)
    struct.pack_into("<Q", wrong_length, 32, 7)  # first buffer's length
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode(wrong_length)
    huge_count = bytearray(record)
    struct.pack_into("<I", huge_count, 8, 2**31)
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode(huge_count)
    garbage = bytearray(record)
    skeleton_start = 32 + 16 * struct.unpack_from("<I", record, 8)[0]
    garbage[skeleton_start : skeleton_start + 8] = b"\xff" * 8
    with pytest.raises(ValueError, match="skeleton"):
        codec.decode(garbage)


def test_unpicklable_parts_are_named_in_a_type_error():
    with pytest.raises(TypeError, match=r"element\['fn'\] of type builtins.function") as info:
        codec.encode({"ok": torch.ones(1), "fn": lambda x: x})
    assert "return tensors, numpy arrays or plain data" in str(info.value)
    assert info.value.__cause__ is not None
    with pytest.raises(
        TypeError, match=r"element\[1\] of type .*HoldsLock: cannot pickle '_thread.lock'"
    ):
        codec.encode((1, HoldsLock()))
    Local = namedtuple("Local", "a")
    with pytest.raises(TypeError, match=r"could not pickle element of type .*Local"):
        codec.encode(Local(1))
    cyclic = [1]
    cyclic.append(cyclic)
    with pytest.raises(TypeError, match=r"element\['f'\] of type builtins.function"):
        codec.encode({"cyclic": cyclic, "f": lambda: 0})


def misaligning_element():
    """Tensors and arrays of odd sizes, each of which would misalign the next if packed."""
    return {
        "tensors": [torch.arange(n, dtype=torch.uint8) for n in (0, 1, 3, 63, 64, 65, 1001)],
        "arrays": [np.arange(n, dtype=np.int16) for n in (0, 1, 5, 33)],
        "nested": (
            Point(torch.ones(3, 5, dtype=torch.float64).t(), np.zeros((0, 7))),
            {"deep": [np.ones(9)[::2]]},
        ),
        "odd dtypes": (
            torch.ones(7, dtype=torch.bfloat16),
            np.array(["ab", "c"]),
            np.zeros(3, structured_dtype()),
        ),
        "scalars": (torch.tensor(1.5), np.float32(2.5), np.array(7, np.int8)),
        "other": ("text", b"y" * 100, 3),
    }


def test_every_tensor_and_array_is_decoded_64_byte_aligned():
    element = misaligning_element()
    record = codec.encode_bytes(element)
    pinned = []
    copied = roundtrip(element)  # from a buffer at an arbitrary address: copies
    allocated = roundtrip(
        element, allocate=lambda shape, dtype: pinned.append(1) or torch.empty(shape, dtype=dtype)
    )
    viewed = codec.decode_view(aligned_base(record))
    for out in (copied, allocated, viewed):
        assert_elements_equal(out, element)
        assert len(data_addresses(out)) == 19  # np.float32(2.5) is a numpy scalar, not an array
        assert misaligned(out) == []
    assert len(pinned) == 10


FRESH = {
    "tensor": lambda i: torch.full((3,), float(i)),
    "array": lambda i: np.full(3, i),
    "bytes": lambda i: bytes([i]) * codec_pickle.RAW_MIN,
    "str": lambda i: str(i) * codec_pickle.RAW_MIN,
}


@pytest.mark.parametrize("kind", sorted(FRESH))
def test_objects_made_while_pickling_never_share_an_id(kind):
    # Each state is freed once pickled, so the next may be built at the same address.
    make = FRESH[kind]
    out = roundtrip([FreshState(functools.partial(make, i)) for i in range(6)])
    assert_elements_equal([x.state for x in out], [make(i) for i in range(6)])


def test_encode_bytes_round_trips_plain_values():
    for value in (None, 0, "", b"", [], {"k": None}, Point(1, 2), 10**40):
        assert_elements_equal(codec.decode_bytes(codec.encode_bytes(value)), value)


def test_decode_view_shares_memory_and_frees_the_record_with_the_last_view():
    import gc
    import weakref

    element = {
        "t": torch.arange(10, dtype=torch.bfloat16),
        "a": np.arange(6.0).reshape(2, 3),
        "n": 3,
        "b": b"y" * 100_000,
        "e": torch.zeros(0, 3),
        "g": torch.ones(2, requires_grad=True),
    }
    base = np.frombuffer(bytearray(codec.encode_bytes(element)), np.uint8)
    freed = []
    out = codec.decode_view(base)
    weakref.finalize(base, freed.append, True)
    assert_elements_equal(
        {k: v for k, v in out.items() if k != "g"}, {k: v for k, v in element.items() if k != "g"}
    )
    assert out["g"].requires_grad and torch.equal(out["g"].detach(), torch.ones(2))
    assert np.shares_memory(out["a"], base) and out["t"].data_ptr() >= base.ctypes.data
    out["t"][0] = 5  # writable
    keep = out["t"]
    del out, base
    gc.collect()
    assert not freed
    del keep
    gc.collect()
    assert freed == [True]


def test_stacked_tensors_are_stacked_straight_into_the_record():
    parts = [torch.full((3, 4), float(i)).t() for i in range(5)]  # non-contiguous parts too
    element = {
        "x": codec.StackedTensor(parts),
        "flags": codec.StackedTensor([torch.ones(2, dtype=torch.bool)] * 3),
        "none": codec.StackedTensor([torch.zeros(0)] * 2),
    }
    out = codec.decode_bytes(codec.encode_bytes(element))
    assert_elements_equal(
        out,
        {
            "x": torch.stack(parts),
            "flags": torch.ones(3, 2, dtype=torch.bool),
            "none": torch.zeros(2, 0),
        },
    )
    with pytest.raises(ValueError, match="one shape and dtype"):
        codec.StackedTensor([torch.zeros(2), torch.zeros(3)])


@pytest.mark.parametrize(
    ("dtype", "row_shape", "stride"),
    [
        (torch.float32, (3,), 16),  # 12-byte rows, padded to 64
        (torch.bool, (2, 5), 64),
        (torch.complex128, (), 4),
        (torch.bfloat16, (33,), 64),  # 66 bytes: 128
        (torch.int64, (8,), 8),  # 64 bytes: no padding, an ordinary contiguous tensor
    ],
)
def test_stacks_of_aligned_rows_decode_as_views_of_aligned_rows(dtype, row_shape, stride):
    parts = [random_tensor(dtype, row_shape, seed=i) for i in range(5)]
    record = codec.encode_bytes(codec.StackedTensor(parts, aligned_rows=True))
    allocated = []

    def allocate(shape, dtype):
        allocated.append(shape)
        return torch.empty(shape, dtype=dtype)

    for out in (
        codec.decode_bytes(record),
        codec.decode_view(aligned_base(record)),
        codec.decode(record, allocate=allocate),
    ):
        assert_elements_equal(out, torch.stack(parts))
        assert out.stride()[0] == stride
        assert [row.data_ptr() % 64 for row in out.unbind(0)] == [0] * 5
    assert allocated == [(5, stride)]


def test_corrupt_row_strides_raise_value_error():
    record = codec.encode_bytes(codec.StackedTensor([torch.ones(3)] * 2, aligned_rows=True))
    assert record.count(struct.pack("<BB", 0x4B, 64)) == 1  # the stride, pickled as BININT1 64
    for bad in (
        12,
        8,
        62,
        128,
    ):  # no padding; shorter than a row; not whole elements; past the buffer
        with pytest.raises(ValueError, match="corrupt"):
            codec.decode(
                record.replace(struct.pack("<BB", 0x4B, 64), struct.pack("<BB", 0x4B, bad))
            )


def test_materialize_stacks_what_was_meant_for_shared_memory():
    parts = [torch.ones(2), torch.zeros(2)]
    out = codec.materialize({"a": codec.StackedTensor(parts), "b": 3})
    assert_elements_equal(out, {"a": torch.stack(parts), "b": 3})
    plain = {"a": torch.ones(1)}
    assert codec.materialize(plain) is plain


def test_stackable_takes_only_plain_cpu_tensors_of_one_shape_and_dtype():
    rows = [torch.full((2, 3), float(i)) for i in range(4)]
    assert codec.stackable(rows)
    stacked = codec.decode_bytes(codec.encode_bytes(codec.StackedTensor(rows, checked=True)))
    assert torch.equal(stacked, torch.stack(rows))

    class Sub(torch.Tensor):
        pass

    others = {
        "shape": torch.zeros(3, 2),
        "dtype": torch.zeros(2, 3, dtype=torch.float64),
        "grad": torch.zeros(2, 3, requires_grad=True),
        "sparse": torch.zeros(2, 3).to_sparse(),
        "subclass": torch.zeros(2, 3).as_subclass(Sub),
    }
    for name, odd in others.items():
        assert not codec.stackable([*rows, odd]), name
        assert not codec.stackable([odd, *rows]), name
    with pytest.raises(ValueError, match="one shape and dtype"):
        codec.StackedTensor([*rows, others["dtype"]])

"""Tests of ``flat_map`` and ``interleave`` (inline and parallel)."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
import torch

import torchpipe as tp
from tests.trees import find_stage
from torchpipe.errors import CheckpointError
from torchpipe.ops.interleave import interleave as interleave_op
from torchpipe.ops.interleave.iterator import InterleaveIterator
from torchpipe.testing import assert_checkpoint_roundtrip

LENS = [3, 1, 4, 0, 2, 5]


def uneven(x: int) -> tp.Dataset:
    """Input element ``x`` -> ``x*10, x*10+1, ...`` (LENS[x] elements; some are empty)."""
    return tp.range(LENS[x]).map(lambda i: x * 10 + i)


def reference_interleave(lens: list[int], cycle: int, block: int) -> list[int]:
    """tf.data's sequential interleave over inner datasets ``[x*100 + i for i < lens[x]]``.

    Checked equal to tf.data 2.21 (sequential, and parallel with deterministic=True) on 300
    random cases of lengths, cycle and block lengths.
    """
    slots: list = [None] * cycle
    inputs = iter(range(len(lens)))
    cycle_index = block_index = num_open = 0
    end, out = False, []
    while not end or num_open:
        slot = slots[cycle_index]
        if slot is None and not end:
            x = next(inputs, None)
            if x is None:
                end = True
            else:
                slots[cycle_index] = iter([x * 100 + i for i in range(lens[x])])
                num_open += 1
            continue
        value = next(slot, None) if slot is not None else None
        if value is not None:
            out.append(value)
            block_index += 1
            if block_index < block:
                continue
        elif slot is not None:
            slots[cycle_index] = None
            num_open -= 1
        block_index, cycle_index = 0, (cycle_index + 1) % cycle
    return out


def random_case(rnd: random.Random) -> tuple[list[int], int, int]:
    lens = [rnd.choice([0, 0, 1, 2, 3, 5, 7]) for _ in range(rnd.randint(0, 8))]
    return lens, rnd.randint(1, 5), rnd.randint(1, 4)


def from_lens(lens: list[int], cycle: int, block: int, **kwargs) -> tp.Dataset:
    return tp.range(len(lens)).interleave(
        lambda x: tp.range(lens[x]).map(lambda i: x * 100 + i),
        cycle_length=cycle,
        block_length=block,
        **kwargs,
    )


def collect(ds: tp.Dataset, limit: int = 100) -> list:
    """Elements of one pass, with ``"E"`` for each ValueError (and the pass continuing)."""
    out: list = []
    with iter(ds) as it:
        while len(out) < limit:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except ValueError:
                out.append("E")
    return out


def fail_at(value: int, bad: int) -> int:
    if value == bad:
        raise ValueError(f"bad value {value}")
    return value


def new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``before`` that are still alive after up to ~5 s of waiting."""
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        alive = set(threading.enumerate()) - before
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


PARALLEL = [{}, {"num_parallel_calls": 1}, {"num_parallel_calls": 2}, {"num_parallel_calls": 4}]


# -- order, verified against tf.data 2.21 ----------------------------------------------------
def test_flat_map_order() -> None:
    # verified against tf.data 2.21
    assert list(tp.range(len(LENS)).flat_map(uneven)) == [
        0,
        1,
        2,
        10,
        20,
        21,
        22,
        23,
        40,
        41,
        50,
        51,
        52,
        53,
        54,
    ]


def test_flat_map_tensor_rows() -> None:
    rows = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    # verified against tf.data 2.21
    assert [int(v) for v in tp.from_tensor_slices(rows).flat_map(tp.from_tensor_slices)] == list(
        range(1, 10)
    )


@pytest.mark.parametrize("kwargs", PARALLEL)
def test_interleave_docs_example(kwargs: dict) -> None:
    ds = tp.range(1, 6).interleave(
        lambda x: tp.from_iterable([x] * 6), cycle_length=2, block_length=4, **kwargs
    )
    # verified against tf.data 2.21 (the example of tf.data.Dataset.interleave's docs)
    want = [
        1,
        1,
        1,
        1,
        2,
        2,
        2,
        2,
        1,
        1,
        2,
        2,
        3,
        3,
        3,
        3,
        4,
        4,
        4,
        4,
        3,
        3,
        4,
        4,
        5,
        5,
        5,
        5,
        5,
        5,
    ]
    assert list(ds) == want


# verified against tf.data 2.21: uneven and empty inner datasets, cycle_length above the
# number of inputs (10), block_length 1, 2 and 3.
UNEVEN = {
    (2, 1): [0, 10, 1, 2, 20, 21, 22, 40, 23, 41, 50, 51, 52, 53, 54],
    (3, 1): [0, 10, 20, 1, 21, 2, 22, 40, 23, 50, 41, 51, 52, 53, 54],
    (2, 3): [0, 1, 2, 10, 20, 21, 22, 23, 40, 41, 50, 51, 52, 53, 54],
    (3, 3): [0, 1, 2, 10, 20, 21, 22, 23, 40, 41, 50, 51, 52, 53, 54],
    (10, 1): [0, 10, 20, 40, 50, 1, 21, 41, 51, 2, 22, 52, 23, 53, 54],
    (10, 2): [0, 1, 10, 20, 21, 40, 41, 50, 51, 2, 22, 23, 52, 53, 54],
    (1, 2): [0, 1, 2, 10, 20, 21, 22, 23, 40, 41, 50, 51, 52, 53, 54],
}


@pytest.mark.parametrize("kwargs", PARALLEL)
@pytest.mark.parametrize("cycle,block", list(UNEVEN))
def test_interleave_uneven(cycle: int, block: int, kwargs: dict) -> None:
    ds = tp.range(len(LENS)).interleave(uneven, cycle_length=cycle, block_length=block, **kwargs)
    assert list(ds) == UNEVEN[cycle, block]


def test_random_cases_match_reference() -> None:
    rnd = random.Random(0)
    for _ in range(60):
        lens, cycle, block = random_case(rnd)
        want = reference_interleave(lens, cycle, block)
        assert list(from_lens(lens, cycle, block)) == want, (lens, cycle, block)
        npc = rnd.randint(1, 6)
        assert list(from_lens(lens, cycle, block, num_parallel_calls=npc)) == want, (
            lens,
            cycle,
            block,
            npc,
        )


def slow_first(x: int) -> tp.Dataset:
    def element(i: int) -> int:
        if x % 3 == 0 and i == 0:
            time.sleep(0.02)  # makes other slots ready first, so the non-deterministic path skips
        return x * 100 + i

    return tp.range(x % 4 + 1).map(element)


def test_non_deterministic_same_multiset() -> None:
    rnd = random.Random(1)
    for _ in range(20):
        lens, cycle, block = random_case(rnd)
        got = list(from_lens(lens, cycle, block, num_parallel_calls=3, deterministic=False))
        assert sorted(got) == sorted(reference_interleave(lens, cycle, block))
    ds = tp.range(9).interleave(
        slow_first, cycle_length=3, num_parallel_calls=3, deterministic=False
    )
    assert sorted(ds) == sorted(tp.range(9).interleave(slow_first, cycle_length=3))


def test_deterministic_option_applies() -> None:
    opts = tp.Options(deterministic=False)
    ds = tp.range(9).interleave(slow_first, cycle_length=3, num_parallel_calls=2).with_options(opts)
    assert sorted(ds) == sorted(tp.range(9).interleave(slow_first, cycle_length=3))


@pytest.mark.parametrize("cores, cycle", [(2, 16), (24, 24)])
def test_autotune_cycle_is_the_cores_and_at_least_16(monkeypatch, cores, cycle) -> None:
    monkeypatch.setattr(interleave_op, "usable_cpu_count", lambda: cores)
    want = list(tp.range(60).interleave(uneven_mod, cycle_length=cycle))
    assert want != list(tp.range(60).interleave(uneven_mod, cycle_length=cycle - 1))
    assert list(tp.range(60).interleave(uneven_mod)) == want
    assert (
        list(
            tp.range(60).interleave(
                uneven_mod, cycle_length=tp.AUTOTUNE, num_parallel_calls=tp.AUTOTUNE
            )
        )
        == want
    )


@pytest.mark.parametrize(
    "executor, cycle, start",
    [("thread", 3, 3), ("thread", 200, 64), ("auto", 16, 16), ("process", 16, 2)],
)
def test_autotuned_readers_start_at_the_cycle_on_threads_and_the_cores_in_processes(
    monkeypatch, executor, cycle, start
) -> None:
    monkeypatch.setattr(interleave_op, "usable_cpu_count", lambda: 2)
    ds = tp.range(4).interleave(
        uneven_mod, cycle_length=cycle, num_parallel_calls=tp.AUTOTUNE, executor=executor
    )
    it = iter(ds.with_options(tp.Options(autotune=tp.AutotuneOptions(enabled=False))))
    next(it)
    (knob,) = find_stage(it, InterleaveIterator).knobs()
    assert knob.value == start
    it.close()


def uneven_mod(x: int) -> tp.Dataset:
    return tp.range(x % 3 + 1).map(lambda i: x * 10 + i)


def test_more_threads_than_cycle() -> None:
    ds = tp.range(len(LENS)).interleave(uneven, cycle_length=2, num_parallel_calls=8)
    assert list(ds) == UNEVEN[2, 1]


def test_tuple_elements_are_unpacked() -> None:
    ds = tp.from_tensor_slices(([1, 2], [10, 20])).interleave(
        lambda a, b: tp.range(a, a + 2).map(lambda i: i + b)
    )
    assert list(ds) == [11, 22, 12, 23]


def test_nested_elements_pass_through() -> None:
    ds = tp.range(2).flat_map(lambda x: tp.from_iterable([{"x": x, "t": torch.tensor([x, x])}]))
    got = list(ds)
    assert [e["x"] for e in got] == [0, 1]
    assert torch.equal(got[1]["t"], torch.tensor([1, 1]))


def test_cardinality_and_explain() -> None:
    ds = tp.range(3).interleave(
        uneven, cycle_length=2, block_length=3, num_parallel_calls=tp.AUTOTUNE
    )
    assert ds.cardinality() == tp.UNKNOWN
    assert tp.range(3).flat_map(uneven).cardinality() == tp.UNKNOWN
    text = ds.explain()
    assert "interleave(" in text and "uneven" in text and "block_length=3" in text


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 2}])
def test_errors_continue_like_tf(kwargs: dict) -> None:
    # verified against tf.data 2.21: an element's error leaves the block where it was; a failed
    # input element or fn call leaves the slot empty and current, so the next input refills it.
    inner = tp.range(4).interleave(
        lambda x: tp.range(3).map(lambda i: fail_at(x * 10 + i, 21)),
        cycle_length=2,
        block_length=2,
        **kwargs,
    )
    assert collect(inner) == [0, 1, 10, 11, 2, 12, 20, "E", 22, 30, 31, 32]
    assert list(inner.ignore_errors()) == [0, 1, 10, 11, 2, 12, 20, 22, 30, 31, 32]
    failing_input = tp.range(4).map(lambda x: fail_at(x, 1))
    ds = failing_input.interleave(
        lambda x: tp.range(3).map(lambda i: x * 10 + i), cycle_length=2, **kwargs
    )
    assert collect(ds) == [0, "E", 20, 1, 21, 2, 22, 30, 31, 32]
    ds = tp.range(4).interleave(fn_fails_at_1, cycle_length=2, **kwargs)
    assert collect(ds) == [0, "E", 20, 1, 21, 2, 22, 30, 31, 32]


def fn_fails_at_1(x: int) -> tp.Dataset:
    fail_at(x, 1)
    return tp.range(3).map(lambda i: x * 10 + i)


def test_flat_map_error_continues_like_tf() -> None:
    ds = tp.range(3).flat_map(lambda x: tp.range(3).map(lambda i: fail_at(x * 10 + i, 21)))
    # verified against tf.data 2.21
    assert collect(ds) == [0, 1, 2, 10, 11, 12, 20, "E", 22]


def raises_key_error(x: int) -> tp.Dataset:
    if x == 2:
        raise KeyError("no such file")
    return tp.range(2)


@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 2}])
def test_fn_error_keeps_type_and_names_stage(kwargs: dict) -> None:
    it = iter(tp.range(4).interleave(raises_key_error, cycle_length=1, **kwargs))
    assert [next(it), next(it), next(it), next(it)] == [0, 1, 0, 1]
    with pytest.raises(KeyError) as info:
        next(it)
    assert any("interleave(raises_key_error)" in note for note in info.value.__notes__)
    assert list(it) == [0, 1]


@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 3}])
def test_inner_error_keeps_type_and_stage(kwargs: dict) -> None:
    def decode(i: int) -> int:
        raise OSError(f"corrupt record {i}")

    ds = tp.range(3).interleave(lambda x: tp.range(2).map(decode), cycle_length=2, **kwargs)
    with pytest.raises(OSError) as info:
        next(iter(ds))
    assert any("map(decode)" in note for note in info.value.__notes__)


@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 2}])
def test_fn_must_return_a_dataset(kwargs: dict) -> None:
    def as_list(x: int) -> list:
        return [x, x]

    with pytest.raises(TypeError, match=r"interleave\(as_list\).*tp.Dataset.*list"):
        list(tp.range(3).interleave(as_list, **kwargs))
    with pytest.raises(TypeError, match=r"flat_map\(as_list\).*list"):
        list(tp.range(3).flat_map(as_list))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError):
        tp.range(3).interleave(uneven, block_length=0.5)
    with pytest.raises(ValueError):
        tp.range(3).interleave(uneven, cycle_length=0)
    with pytest.raises(TypeError):
        tp.range(3).flat_map([1, 2])


# -- randomness --------------------------------------------------------------------------------
def shuffled(x: int) -> tp.Dataset:
    return tp.range(x * 10, x * 10 + 8).shuffle(5)


def noisy(x: int) -> tp.Dataset:
    return tp.range(3).map(lambda i: int(tp.rng().integers(1_000_000)))


@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 3}])
def test_inner_random_ops_reproducible(kwargs: dict) -> None:
    def make(**kwargs) -> tp.Dataset:
        ds = tp.range(4).interleave(shuffled, cycle_length=2, block_length=3, **kwargs)
        return ds.with_options(tp.Options(seed=7))

    first = list(make(**kwargs))
    assert first == list(make(**kwargs)) == list(make())
    assert sorted(first) == sorted(x * 10 + i for x in range(4) for i in range(8))
    # each inner dataset gets its own seed: the four shuffles are not all the same permutation
    orders = {tuple(v - x * 10 for v in first if v // 10 == x) for x in range(4)}
    assert len(orders) > 1
    values = list(
        tp.range(4).interleave(noisy, cycle_length=2, **kwargs).with_options(tp.Options(seed=3))
    )
    assert values == list(
        tp.range(4).interleave(noisy, cycle_length=2).with_options(tp.Options(seed=3))
    )
    assert len(set(values)) == len(values)


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", PARALLEL[:3])
def test_checkpoint_roundtrip_interleave(kwargs: dict) -> None:
    for cycle, block in [(2, 1), (3, 3), (10, 2)]:
        assert_checkpoint_roundtrip(tp.range(len(LENS)).interleave(uneven, cycle, block, **kwargs))
    ds = tp.range(1, 6).interleave(
        lambda x: tp.from_iterable([x] * 6), cycle_length=2, block_length=4, **kwargs
    )
    assert_checkpoint_roundtrip(ds)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_parallel_calls": 2, "executor": "thread"},
        {"num_parallel_calls": 2, "executor": "process"},
    ],
)
def test_take_gives_in_chunks_what_next_gives_one_by_one(kwargs: dict) -> None:
    lens, cycle, block = [3, 1, 4, 0, 2, 5, 7, 1], 3, 2
    expected = reference_interleave(lens, cycle, block)
    bare = tp.Options(optimizations={"inject_prefetch": False})  # the interleave is the pass's root
    with iter(from_lens(lens, cycle, block, **kwargs).with_options(bare)) as it:
        chunks = [[next(it)]]
        stage = find_stage(it, InterleaveIterator)
        chunks.append(stage.take(4))
        state = it.state_dict()  # a checkpoint after a chunk stands where 5 calls of next() stand
        while True:
            try:
                chunks.append(stage.take(4))
            except StopIteration:
                break
        assert stage.stats.produced == len(expected)
    assert [len(chunk) for chunk in chunks] == [1] + [4] * ((len(expected) - 1) // 4) + [
        (len(expected) - 1) % 4
    ]
    assert [x for chunk in chunks for x in chunk] == expected
    with iter(from_lens(lens, cycle, block, **kwargs)) as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == expected[5:]
    # a fused map and batch takes its chunks from the interleave: the batches are the elements'
    batches = (
        from_lens(lens, cycle, block, **kwargs).map(lambda x: x + 1, num_parallel_calls=2).batch(4)
    )
    assert [x for b in batches for x in b.tolist()] == [x + 1 for x in expected]


@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 2}])
def test_checkpoint_roundtrip_with_repeat_and_shuffle(kwargs: dict) -> None:
    ds = tp.range(len(LENS)).interleave(uneven, cycle_length=3, block_length=2, **kwargs)
    assert_checkpoint_roundtrip(ds.repeat(2))
    assert_checkpoint_roundtrip(
        tp.range(len(LENS)).repeat(2).interleave(uneven, cycle_length=4, **kwargs)
    )
    assert_checkpoint_roundtrip(ds.shuffle(4, seed=1))
    assert_checkpoint_roundtrip(
        tp.range(len(LENS)).shuffle(3, seed=2).interleave(uneven, 2, 2, **kwargs)
    )
    inner_random = tp.range(4).interleave(shuffled, cycle_length=2, block_length=3, **kwargs)
    assert_checkpoint_roundtrip(inner_random.with_options(tp.Options(seed=5)))
    inner_repeat = tp.range(3).interleave(lambda x: uneven(x).repeat(2), cycle_length=2, **kwargs)
    assert_checkpoint_roundtrip(inner_repeat)


def test_checkpoint_roundtrip_flat_map() -> None:
    assert_checkpoint_roundtrip(tp.range(len(LENS)).flat_map(uneven))
    assert_checkpoint_roundtrip(tp.range(len(LENS)).flat_map(uneven).repeat(2))
    assert_checkpoint_roundtrip(tp.range(4).flat_map(shuffled).with_options(tp.Options(seed=1)))


@pytest.mark.parametrize("kwargs", [{}, {"num_parallel_calls": 2}])
def test_checkpoint_roundtrip_through_errors(kwargs: dict) -> None:
    ds = (
        tp.range(4)
        .map(lambda x: fail_at(x, 1))
        .interleave(
            lambda x: tp.range(3).map(lambda i: fail_at(x * 10 + i, 21)),
            cycle_length=2,
            block_length=2,
            **kwargs,
        )
    )
    assert_checkpoint_roundtrip(ds.ignore_errors())


def test_checkpoint_random_cases() -> None:
    rnd = random.Random(2)
    for _ in range(6):
        lens, cycle, block = random_case(rnd)
        assert_checkpoint_roundtrip(
            from_lens(lens, cycle, block, num_parallel_calls=rnd.randint(1, 4))
        )


def test_checkpoint_state_is_shared_between_inline_and_parallel() -> None:
    inline = tp.range(len(LENS)).interleave(uneven, cycle_length=3, block_length=2)
    parallel = tp.range(len(LENS)).interleave(
        uneven, cycle_length=3, block_length=2, num_parallel_calls=2
    )
    with iter(inline) as it:
        head = [next(it) for _ in range(5)]
        state = it.state_dict()
    with iter(parallel) as resumed:
        resumed.load_state_dict(state)
        assert head + list(resumed) == list(inline)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_checkpoint_non_deterministic_resumes_remaining_elements(executor: str) -> None:
    ds = tp.range(9).interleave(
        slow_first,
        cycle_length=3,
        block_length=2,
        num_parallel_calls=3,
        deterministic=False,
        executor=executor,
    )
    with iter(ds) as it:
        head = [next(it) for _ in range(7)]
        state = it.state_dict()
        tail = list(it)
    with iter(ds) as resumed:
        resumed.load_state_dict(state)
        assert sorted(resumed) == sorted(tail)
    assert sorted(head + tail) == sorted(tp.range(9).interleave(slow_first, cycle_length=3))


def _rng(state: int, has_uint32: int, uinteger: int) -> dict:
    inc = 200833649129300423505225703336343220001
    return {
        "bit_generator": "PCG64",
        "state": {"state": state, "inc": inc},
        "has_uint32": has_uint32,
        "uinteger": uinteger,
    }


# Saved by the interleave iterators before they shared one state machine over reader pools (commit
# 430b870): one inline after 3 elements, one on threads after 7, of the pipeline below.
OPS = [
    "interleave(fn=uneven, cycle_length=3, block_length=2)",
    "shuffle(buffer_size=3, seed=1, reshuffle_each_iteration=True)",
    "range(start=0, stop=6, step=1, len=6)",
    "->",
    "interleave",
    "shuffle",
    "range",
]
SAVED = [
    (
        {
            "format": 3,
            "ops": OPS,
            "seed": 458692184222912420,
            "epoch": 0,
            "pipeline": {
                "input": {
                    "input": {"index": 4},
                    "buffer": [0, 3],
                    "input_done": False,
                    "rng": _rng(135221972152563403490726731193101921352, 0, 1819963395),
                },
                "seq": 2,
                "cycle_index": 1,
                "block_index": 1,
                "end_of_input": False,
                "slots": [
                    {"element": 2, "seq": 0, "inner": {"input": {"index": 2}, "seq": 2}},
                    {"element": 1, "seq": 1, "inner": {"input": {"index": 1}, "seq": 1}},
                    None,
                ],
            },
        },
        [40, 41, 22, 23, 50, 51, 0, 1, 52, 53, 2, 54],
    ),
    (
        {
            "format": 3,
            "ops": OPS,
            "seed": 185045594099368695,
            "epoch": 0,
            "pipeline": {
                "input": {
                    "input": {"index": 5},
                    "buffer": [0, 3],
                    "input_done": False,
                    "rng": _rng(183521842008194837021422278924743593609, 1, 1705563963),
                },
                "seq": 3,
                "cycle_index": 1,
                "block_index": 0,
                "end_of_input": False,
                "slots": [
                    {"element": 2, "seq": 0, "inner": {"input": {"index": 4}, "seq": 4}},
                    None,
                    {"element": 4, "seq": 2, "inner": {"input": {"index": 2}, "seq": 2}},
                ],
            },
        },
        [50, 51, 0, 1, 52, 53, 2, 54],
    ),
]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_parallel_calls": 2, "executor": "thread"},
        {"num_parallel_calls": 2, "executor": "process"},
        {"num_parallel_calls": 2},
    ],
)
def test_checkpoints_saved_before_the_reader_pools_still_load(kwargs: dict) -> None:
    ds = (
        tp.range(len(LENS))
        .shuffle(3, seed=1)
        .interleave(uneven, cycle_length=3, block_length=2, **kwargs)
    )
    for state, rest in SAVED:
        with iter(ds) as resumed:
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state  # the same state, read back as it was saved
            assert list(resumed) == rest


@pytest.mark.parametrize(
    "key, value", [("cycle_index", 3), ("block_index", -1), ("seq", "2"), ("end_of_input", 0)]
)
def test_a_malformed_state_value_is_a_checkpoint_error_naming_the_key(key: str, value) -> None:
    ds = tp.range(len(LENS)).interleave(
        uneven, cycle_length=3, block_length=2, num_parallel_calls=2
    )
    with iter(ds) as it:
        next(it)
        state = it.state_dict()
    state["pipeline"][key] = value
    with iter(ds) as other, pytest.raises(CheckpointError, match=key):
        other.load_state_dict(state)


def test_checkpoint_from_other_cycle_length_is_rejected() -> None:
    with iter(tp.range(4).interleave(uneven, cycle_length=2)) as it:
        next(it)
        state = it.state_dict()
    with (
        iter(tp.range(4).interleave(uneven, cycle_length=3)) as other,
        pytest.raises(CheckpointError),
    ):
        other.load_state_dict(state)


# -- threads -----------------------------------------------------------------------------------
def test_close_and_gc_stop_threads() -> None:
    before = set(threading.enumerate())
    ds = tp.range(20).interleave(lambda x: tp.range(100), cycle_length=4, num_parallel_calls=4)
    it = iter(ds)
    next(it)
    assert set(threading.enumerate()) - before
    it.close()
    assert not new_threads(before)
    it = iter(ds)
    next(it)
    del it
    assert not new_threads(before)
    nested = tp.range(3).interleave(
        lambda x: tp.range(4).interleave(
            lambda y: tp.range(50), cycle_length=2, num_parallel_calls=2
        ),
        cycle_length=2,
        num_parallel_calls=2,
    )
    it = iter(nested)
    next(it)
    del it
    assert not new_threads(before)


def test_parallel_nested_matches_inline() -> None:
    def nested(**kwargs) -> tp.Dataset:
        return tp.range(4).interleave(
            lambda x: tp.range(3).interleave(
                lambda y: tp.range(x + y).map(lambda i: (x, y, i)), 2, 2, **kwargs
            ),
            cycle_length=3,
            **kwargs,
        )

    assert list(nested(num_parallel_calls=2)) == list(nested())


def _hangs_at_three(x):
    return tp.range(2).map(lambda y: (time.sleep(30) if x == 3 else None, (x, y))[1])


@pytest.mark.parametrize(
    "executor, deterministic", [("thread", True), ("thread", False), ("process", True)]
)
def test_a_hung_reader_raises_a_stall_error(executor, deterministic):
    options = tp.Options(stall_timeout=1.0, optimizations={"inject_prefetch": False})
    ds = tp.range(6).interleave(
        _hangs_at_three,
        cycle_length=2,
        num_parallel_calls=2,
        executor=executor,
        deterministic=deterministic,
    )
    it = iter(ds.with_options(options))
    t0 = time.monotonic()
    with pytest.raises(tp.StallError, match=r"interleave\(_hangs_at_three\)") as info:
        list(it)
    assert time.monotonic() - t0 < 20
    where = "thread interleave(_hangs_at_three)" if executor == "thread" else "worker process"
    assert info.value.where.startswith(where)
    it.close()

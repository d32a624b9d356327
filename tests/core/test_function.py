"""The call of a user function (``torchpipe/core/function.py``): ``tp.rng()`` seeded by stage and
element, the global RNGs seeded only in a seeded pipeline, a batch of elements called as the same
elements one at a time, errors that keep their type with a note naming stage and element, and a
``StopIteration`` that cannot end the pipeline silently."""

from __future__ import annotations

import random
from collections import namedtuple

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.core.function import UserFunction
from torchpipe.core.node import BuildContext
from torchpipe.options import Options

Pair = namedtuple("Pair", "a b")


def _ctx(seeded: bool = False, seed: int = 1234, epoch: int = 0) -> BuildContext:
    return BuildContext(seed=seed, seeded=seeded, epoch=epoch, options=Options())


def _draw(x):
    return x, int(tp.rng().integers(1 << 30))


def _draw_globals(x):
    return random.random(), float(np.random.random()), float(torch.rand(()))


def _args(*args):
    return args


def _fail_at_three(x):
    if x == 3:
        raise KeyError("missing")
    return x


def _stop(x):
    raise StopIteration


# -- calling -------------------------------------------------------------------------------------
def test_a_plain_tuple_is_unpacked_into_arguments_and_other_elements_are_one_argument():
    fn = UserFunction(_args, "map(f)", _ctx())
    assert fn.on_element(0, (1, 2)) == (1, 2)
    assert fn.on_element(0, [1, 2]) == ([1, 2],)
    assert fn.on_element(0, Pair(1, 2)) == (Pair(1, 2),)
    assert fn(0, 1, 2) == (1, 2)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_batch_of_elements_gives_what_they_give_one_at_a_time(seeded):
    fn = UserFunction(_draw, "map(f)", _ctx(seeded))
    elements = list(range(5))
    assert fn.on_elements(10, elements) == [
        fn.on_element(10 + j, x) for j, x in enumerate(elements)
    ]
    assert fn.on_elements(10, []) == []
    pairs = UserFunction(_args, "map(f)", _ctx(seeded))
    assert pairs.on_elements(0, [(1, 2), [3]]) == [(1, 2), ([3],)]


@pytest.mark.parametrize("seeded", [False, True])
def test_then_takes_each_result_with_its_index_in_the_batch(seeded):
    fn = UserFunction(_args, "map(f)", _ctx(seeded))
    taken = []
    results = fn.on_elements(5, ["a", "b"], then=lambda j, r: taken.append((j, r)) or j)
    assert results == [0, 1] and taken == [(0, ("a",)), (1, ("b",))]


# -- tp.rng() ------------------------------------------------------------------------------------
def test_tp_rng_depends_on_the_element_and_not_on_call_order():
    fn = UserFunction(_draw, "map(f)", _ctx())
    forward = [fn.on_element(seq, 0)[1] for seq in range(4)]
    backward = [fn.on_element(seq, 0)[1] for seq in reversed(range(4))]
    assert forward == backward[::-1]
    assert len(set(forward)) == 4


def test_tp_rng_depends_on_the_pipeline_seed_the_stages_place_and_the_epoch():
    ctx = _ctx()
    draws = {
        "here": UserFunction(_draw, "map(f)", ctx).on_element(0, 0),
        "other seed": UserFunction(_draw, "map(f)", _ctx(seed=99)).on_element(0, 0),
        "other place": UserFunction(_draw, "map(f)", ctx.child(1)).on_element(0, 0),
        "next epoch": UserFunction(_draw, "map(f)", _ctx(epoch=1)).on_element(0, 0),
    }
    assert len(set(draws.values())) == 4
    assert (
        UserFunction(_draw, "map(g)", ctx).on_element(0, 0) == draws["here"]
    )  # the name is not the place


def test_tp_rng_gives_one_generator_a_call_and_is_refused_outside_one():
    def same_generator(x):
        return tp.rng() is tp.rng()

    assert UserFunction(same_generator, "map(f)", _ctx())(0, None)
    with pytest.raises(RuntimeError, match="inside a function run by a torchpipe pipeline"):
        tp.rng()
    with pytest.raises(KeyError):
        UserFunction(_fail_at_three, "map(f)", _ctx())(0, 3)
    with pytest.raises(RuntimeError, match="inside a function"):
        tp.rng()  # the failed call left nothing behind


def test_a_batchs_elements_each_get_their_own_generator_as_one_at_a_time():
    def draws(x):
        generator = tp.rng()
        return float(generator.random()), tp.rng() is generator

    fn = UserFunction(draws, "map(f)", _ctx())
    batch = fn.on_elements(5, [0, 0, 0, 0])
    assert batch == [fn.on_element(seq, 0) for seq in range(5, 9)]
    assert len({value for value, _ in batch}) == 4 and all(same for _, same in batch)


def test_a_nested_call_restores_the_outer_elements_generator():
    inner = UserFunction(_draw, "map(inner)", _ctx().child(1))

    def outer(x):
        before = tp.rng()
        inner.on_element(7, x)
        return tp.rng() is before

    assert UserFunction(outer, "map(outer)", _ctx())(0, 1)


# -- the global RNGs -----------------------------------------------------------------------------
def test_a_seeded_pipeline_seeds_the_global_rngs_by_element():
    fn = UserFunction(_draw_globals, "map(f)", _ctx(seeded=True))
    assert fn.seeds_globals
    first = fn.on_element(3, 0)
    random.random(), np.random.random(), torch.rand(())  # move the streams on between calls
    assert fn.on_element(3, 0) == first
    assert fn.on_element(4, 0) != first
    assert fn.on_elements(3, [0, 0]) == [first, fn.on_element(4, 0)]


def test_an_unseeded_pipeline_leaves_the_global_rngs_alone():
    for fn in (
        UserFunction(_draw_globals, "map(f)", _ctx()),
        UserFunction(_draw_globals, "f", _ctx(True), False),
    ):
        assert not fn.seeds_globals
        random.seed(5), np.random.seed(5), torch.manual_seed(5)
        expected = _draw_globals(None)
        random.seed(5), np.random.seed(5), torch.manual_seed(5)
        assert fn.on_element(0, None) == expected
        random.seed(5), np.random.seed(5), torch.manual_seed(5)
        assert fn.on_elements(0, [None]) == [expected]


def test_seed_worker_gives_each_worker_slot_its_own_streams_unless_calls_seed_them():
    fn = UserFunction(_draw_globals, "map(f)", _ctx())
    draws = []
    for slot in (0, 1, 0):
        fn.seed_worker(slot)
        draws.append(_draw_globals(None))
    assert draws[0] == draws[2] != draws[1]

    seeded = UserFunction(_draw_globals, "map(f)", _ctx(seeded=True))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = _draw_globals(None)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    seeded.seed_worker(0)
    assert _draw_globals(None) == expected


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seeded", [False, True])
def test_an_error_keeps_its_type_and_gets_a_note_naming_the_stage_and_element(seeded):
    fn = UserFunction(_fail_at_three, "map(decode)", _ctx(seeded))
    with pytest.raises(KeyError) as info:
        fn.on_element(8, 3)
    assert info.value.__notes__ == ["raised in torchpipe stage map(decode) at element 8"]
    with pytest.raises(KeyError) as info:
        fn.on_elements(20, [0, 1, 2, 3, 4])
    assert info.value.__notes__ == ["raised in torchpipe stage map(decode) at element 23"]


@pytest.mark.parametrize("seeded", [False, True])
def test_a_stop_iteration_from_the_function_becomes_a_runtime_error(seeded):
    fn = UserFunction(_stop, "map(f)", _ctx(seeded))
    with pytest.raises(RuntimeError, match=r"^map\(f\) raised StopIteration at element 4$") as info:
        fn.on_element(4, 0)
    assert isinstance(info.value.__cause__, StopIteration)
    with pytest.raises(RuntimeError, match=r"raised StopIteration at element 6$"):
        fn.on_elements(6, [0, 0])

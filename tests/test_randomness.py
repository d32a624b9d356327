import random
import time

import numpy as np
import pytest
import torch

import torchpipe as tp
from torchpipe.randomness import fresh_seed, mix_seed


def test_rng_outside_a_pipeline_is_an_error():
    with pytest.raises(RuntimeError, match="inside a function"):
        tp.rng()


def test_mix_seed_is_order_sensitive_and_63_bit():
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert mix_seed(1, 2) == mix_seed(1, 2)
    assert 0 <= mix_seed(2**70, -5) < 2**63
    assert fresh_seed() != fresh_seed()


def draws(x):
    return float(tp.rng().random()), float(tp.rng().random())


def test_rng_same_generator_within_a_call_and_reproducible_with_a_seed():
    ds = tp.range(5).map(draws).with_options(tp.Options(seed=7))
    first = list(ds)
    assert all(a != b for a, b in first)  # the second call continues the same stream
    assert first == list(tp.range(5).map(draws).with_options(tp.Options(seed=7)))
    assert first != list(tp.range(5).map(draws).with_options(tp.Options(seed=8)))


def test_rng_identical_inline_and_on_threads():
    seeded = tp.Options(seed=3)
    inline = list(tp.range(20).map(draws).with_options(seeded))
    threaded = list(tp.range(20).map(draws, num_parallel_calls=4).with_options(seeded))
    assert inline == threaded


def test_each_epoch_draws_anew_but_reproducibly():
    ds = tp.range(4).map(draws).with_options(tp.Options(seed=1))
    e0, e1 = list(ds), list(ds)
    assert e0 != e1
    again = tp.range(4).map(draws).with_options(tp.Options(seed=1))
    assert [list(again), list(again)] == [e0, e1]


def global_draws(x):
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_global_rngs_seeded_per_element_when_the_pipeline_has_a_seed():
    ds = tp.range(6).map(global_draws).with_options(tp.Options(seed=11))
    a = list(ds)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    b = list(tp.range(6).map(global_draws).with_options(tp.Options(seed=11)))
    assert a == b and len(set(a)) == 6


def test_a_resume_skips_the_first_elements_without_changing_the_others_draws():
    calls = []

    def counted(x):
        calls.append(x)
        return global_draws(x)

    seeded = tp.Options(seed=11)
    whole = list(tp.range(6).map(counted).with_options(seeded))
    it = iter(tp.range(6).map(counted).with_options(seeded))
    head = [next(it), next(it)]
    state = it.state_dict()
    it.close()
    calls.clear()
    resumed = iter(tp.range(6).map(counted).with_options(seeded))
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert calls == [2, 3, 4, 5]  # elements 0 and 1 were never drawn for in the resumed run
    assert head + rest == whole


def slow_draws(x):
    """Two draws from ``tp.rng()`` with a pause between them, so that calls on threads interleave."""
    first = float(tp.rng().random())
    time.sleep(0.005)
    return x, first, float(tp.rng().random())


def test_rng_state_is_per_thread():
    seeded = tp.Options(seed=5)
    inline = list(tp.range(8).map(slow_draws).with_options(seeded))
    threaded = list(
        tp.range(8).map(slow_draws, num_parallel_calls=4, executor="thread").with_options(seeded)
    )
    assert threaded == inline  # another thread's call in between did not move this call's generator
    assert len({draw for _, a, b in inline for draw in (a, b)}) == 16
    with pytest.raises(RuntimeError):
        tp.rng()

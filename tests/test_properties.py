"""Properties over many pipelines (hypothesis): a checkpoint at any element resumes exactly the
rest, and the output does not depend on the parallelism.

Examples run inline or on threads only (a process pool per example would cost seconds); the
profiles are in ``tests/conftest.py``.
"""

import functools
import pickle

from hypothesis import given
from hypothesis import strategies as st

import torchpipe as tp
from torchpipe.testing import assert_same_elements

PARALLELISM = st.sampled_from([None, 1, 2, 4])  # None: inline


def _double(x):
    return 2 * x


def _block(x):
    return tp.range(10 * x, 10 * x + x % 4 + 1)  # inputs of different lengths


def _multiple_of(modulus, x):
    return x % modulus == 0


def _shuffle_map_batch(n, buffer, batch, drop, seed, parallelism):
    ds = tp.range(n).shuffle(buffer).map(_double, num_parallel_calls=parallelism, executor="thread")
    return ds.batch(batch, drop_remainder=drop).with_options(tp.Options(seed=seed))


def _interleave(n, cycle, block, parallelism):
    return tp.range(n).interleave(
        _block,
        cycle_length=cycle,
        block_length=block,
        num_parallel_calls=parallelism,
        executor="thread",
    )


def _filter(n, modulus, buffer, seed, parallelism):
    ds = tp.range(n).map(_double, num_parallel_calls=parallelism, executor="thread")
    ds = ds.filter(functools.partial(_multiple_of, modulus))
    return ds.shuffle(buffer).with_options(tp.Options(seed=seed))


SEEDS = st.integers(0, 2**32)
MAKERS = st.one_of(
    st.builds(
        functools.partial,
        st.just(_shuffle_map_batch),
        n=st.integers(0, 40),
        buffer=st.integers(1, 16),
        batch=st.integers(1, 7),
        drop=st.booleans(),
        seed=SEEDS,
    ),
    st.builds(
        functools.partial,
        st.just(_interleave),
        n=st.integers(3, 12),
        cycle=st.integers(2, 4),
        block=st.integers(1, 3),
    ),
    st.builds(
        functools.partial,
        st.just(_filter),
        n=st.integers(0, 60),
        modulus=st.integers(1, 5),
        buffer=st.integers(1, 8),
        seed=SEEDS,
    ),
)
"""Pipelines with drawn sizes and seeds, as functions of the parallelism of their parallel stage:
shuffle, map and batch; interleave of inputs of different lengths; map, filter and shuffle."""


def _split(ds, k):
    """A pass over ``ds``: its pickled state after ``k`` elements (or at its end), the elements
    before and the elements after."""
    it = iter(ds)
    try:
        head = []
        for _ in range(k):
            try:
                head.append(next(it))
            except StopIteration:
                break
        return pickle.dumps(it.state_dict()), head, list(it)
    finally:
        it.close()


@given(make=MAKERS, parallelism=PARALLELISM, where=st.integers(0, 1000))
def test_a_checkpoint_at_any_element_resumes_exactly_the_rest(make, parallelism, where):
    whole = _split(make(parallelism=parallelism), 0)[2]
    ds = make(parallelism=parallelism)  # a new Dataset: its first pass is epoch 0 again
    state, head, rest = _split(ds, where % (len(whole) + 1))  # any element of the pass, or its end
    resumed = iter(ds)
    try:
        resumed.load_state_dict(pickle.loads(state))
        assert_same_elements(list(resumed), rest)
    finally:
        resumed.close()
    if ds.options().seed is not None:  # the same epoch and seed: the same elements
        assert_same_elements(head + rest, whole)


@given(make=MAKERS, parallelism=st.sampled_from([1, 2, 4]))
def test_the_output_does_not_depend_on_the_parallelism(make, parallelism):
    assert_same_elements(list(make(parallelism=parallelism)), list(make(parallelism=None)))

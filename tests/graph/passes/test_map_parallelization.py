import threading

import pytest

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites, running_root


def noisy(x):
    return x + tp.rng().random()


def test_pure_maps_run_in_parallel_with_the_same_output():
    ds = tp.range(40).map(noisy, pure=True).with_options(tp.Options(seed=6))
    assert_pass_keeps_output(ds, "map_parallelization")
    root = running_root(only(ds, "map_parallelization"))
    assert root.num_parallel_calls == tp.AUTOTUNE


def test_the_decorator_declares_purity():
    @tp.pure
    def where(x):
        return threading.get_ident()

    ds = only(tp.range(30).map(where, executor="thread"), "map_parallelization")
    assert running_root(ds).num_parallel_calls == tp.AUTOTUNE
    assert threading.get_ident() not in set(ds)  # not one call ran on this thread


def test_undeclared_maps_stay_sequential():
    assert "map_parallelization" not in rewrites(
        only(tp.range(3).map(noisy), "map_parallelization")
    )


def test_pure_cannot_mark_builtins():
    with pytest.raises(TypeError, match="pure=True"):
        tp.pure(len)
    with pytest.raises(TypeError, match="callable"):
        tp.pure(3)

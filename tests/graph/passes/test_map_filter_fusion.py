import pytest

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites, running_root
from torchpipe.ops.fused import FusedMapNode


def noisy(x):
    return x + tp.rng().random()


@tp.pure
def small(x):
    return x - int(x) < 0.5


def test_inline_map_then_filter():
    ds = tp.range(40).map(noisy).filter(small).map(noisy).with_options(tp.Options(seed=9))
    assert_pass_keeps_output(ds, "map_filter_fusion")


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_filter_runs_where_the_parallel_map_ran(executor):
    ds = (
        tp.range(40).map(noisy, 2, executor=executor).filter(small).with_options(tp.Options(seed=9))
    )
    kept = assert_pass_keeps_output(ds, "map_filter_fusion")
    assert 0 < len(kept) < 40
    root = running_root(only(ds, "map_filter_fusion"))
    assert isinstance(root, FusedMapNode) and root.num_parallel_calls == 2


def test_unordered_parallel_chain_drops_the_same_elements():
    ds = (
        tp.range(50)
        .map(noisy, 2, deterministic=False)
        .filter(small)
        .with_options(tp.Options(seed=3))
    )
    on, expected = only(ds, "map_filter_fusion"), list(only(ds))
    assert sorted(on) == sorted(expected)


def impure_small(x):
    return small(x)


def test_a_seeded_pipeline_keeps_impure_inline_functions_off_threads():
    ds = tp.range(10).map(noisy, 2, executor="thread").filter(impure_small)
    assert "map_filter_fusion" in rewrites(only(ds, "map_filter_fusion"))
    assert "map_filter_fusion" not in rewrites(
        only(ds.with_options(tp.Options(seed=1)), "map_filter_fusion")
    )
    in_processes = tp.range(10).map(noisy, 2, executor="process").filter(impure_small)
    assert "map_filter_fusion" in rewrites(
        only(in_processes.with_options(tp.Options(seed=1)), "map_filter_fusion")
    )


def test_no_stage_follows_a_filter_in_parallel():
    # filter(a).filter(b) fused inline, then map(noisy, 2) below: b would see the wrong count
    ds = tp.range(30).map(noisy, 2).filter(small).filter(small)
    on = only(ds, "filter_fusion", "map_filter_fusion")
    assert "map_filter_fusion" not in rewrites(on) and "filter_fusion" in rewrites(on)
    assert_pass_keeps_output(ds.with_options(tp.Options(seed=2)), "map_filter_fusion")

"""Element-wise chains run as one stage (ops/fused.py): the fused node, its inline iterator."""

import pytest

import torchpipe as tp
from tests.graph.passes.toggle import only, running_root
from torchpipe.errors import CheckpointError
from torchpipe.ops.fused import FusedMapNode, is_pure_stage
from torchpipe.testing import assert_checkpoint_roundtrip, node


def double(x):
    return 2 * x


def even(x):
    return x % 4 == 0


def _fused(ds, stages):
    """``ds``'s last ``stages`` maps and filters as one inline stage, as the passes would make
    them (and a filter before a map too, which they do not fuse)."""
    hops, below = [], node(ds)
    for _ in range(stages):
        hops.append(below)
        below = below.inputs[0]
    return only(tp.Dataset(FusedMapNode(tuple(hops), below, None, None, "auto")))


def _counts_state(state):
    """The fused stage's state within a pass's ``state``."""
    if isinstance(state, dict):
        if "counts" in state and "input" in state:
            return state
        for value in state.values():
            found = _counts_state(value)
            if found is not None:
                return found
    return None


def test_the_fused_node_names_its_stages_innermost_first():
    ds = tp.range(8).map(double, 2).map(double, 2).filter(even)
    fused = running_root(only(ds, "map_fusion", "map_filter_fusion"))
    assert isinstance(fused, FusedMapNode) and fused.has_filter() and not fused.pure
    assert [stage.name for stage in fused.stages] == ["map(double)", "map(double)", "filter(even)"]
    inner = " -> ".join(stage.label() for stage in fused.stages)
    parallel = "num_parallel_calls=2, deterministic=None, executor='auto'"
    assert fused.label() == f"fused[{inner}]({parallel})"
    assert fused.params()["stages"] == [stage.label() for stage in fused.stages]


def test_a_stage_is_pure_only_where_its_function_was_declared_so():
    assert is_pure_stage(node(tp.range(2).map(double, pure=True)))
    assert not is_pure_stage(node(tp.range(2).map(double)))
    assert is_pure_stage(node(tp.range(2).filter(tp.pure(lambda x: x > 0))))
    assert not is_pure_stage(node(tp.range(2).filter(even)))
    assert not is_pure_stage(node(tp.range(2)))


def test_an_inline_chain_gives_what_the_ops_give_apart_and_resumes_anywhere():
    ds = tp.range(24).map(double).filter(lambda x: x % 3 < 2).map(lambda x: x + 1)
    fused = _fused(ds, 3)
    assert isinstance(running_root(fused), FusedMapNode)
    assert list(fused) == list(only(ds))
    assert_checkpoint_roundtrip(fused)


def test_an_inline_chain_counts_what_reaches_each_stage_and_refuses_other_counts():
    ds = _fused(tp.range(12).map(double).filter(even).map(double), 3)
    with iter(ds) as it:
        assert [next(it), next(it)] == [0, 8]
        state = it.state_dict()
    assert _counts_state(state)["counts"] == [3, 3, 2]  # 0, 1, 2 read: 0 and 2 kept
    for counts in ([1, 1], [1, -1, 1], [1, 1.0, 1], "3"):
        _counts_state(state)["counts"] = counts
        with iter(ds) as it, pytest.raises(CheckpointError, match="must be 3 counts"):
            it.load_state_dict(state)

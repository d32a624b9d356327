"""What the fusion passes share (graph/passes/_elementwise.py): which stages fuse, and how."""

import torchpipe as tp
from torchpipe.constants import AUTOTUNE
from torchpipe.graph.passes._elementwise import apply_fusion, fuse, stage_kinds
from torchpipe.ops.fused import FusedMapNode
from torchpipe.options import Options


def double(x):
    return 2 * x


def even(x):
    return x % 2 == 0


def _any(outer, inner):
    return True


def _node(ds):
    return ds._node


def test_stage_kinds_tell_maps_filters_and_fused_chains_innermost_first():
    source = tp.range(4)
    assert stage_kinds(_node(source)) is None
    assert stage_kinds(_node(source.map(double))) == ("map",)
    assert stage_kinds(_node(source.filter(even))) == ("filter",)
    fused = fuse(_node(source.filter(even).map(double)), Options(), _any)
    assert stage_kinds(fused) == ("filter", "map")


def test_inline_stages_fuse_inline_and_a_parallel_one_takes_the_inline_one_along():
    inline = fuse(_node(tp.range(4).map(double).map(double)), Options(), _any)
    assert isinstance(inline, FusedMapNode) and inline.num_parallel_calls is None
    parallel = fuse(
        _node(tp.range(4).map(double).map(double, 3, executor="thread")), Options(), _any
    )
    assert (parallel.num_parallel_calls, parallel.executor) == (3, "thread")
    assert [stage.name for stage in parallel.stages] == ["map(double)", "map(double)"]


def test_parallel_settings_merge_or_clash():
    def fused(inner, outer):
        return fuse(_node(tp.range(4).map(double, *inner).map(double, *outer)), Options(), _any)

    merged = fused((2, None, "auto"), (4, None, "process"))
    assert (merged.num_parallel_calls, merged.executor) == (4, "process")
    assert fused((2, None, "thread"), (AUTOTUNE, None, "auto")).num_parallel_calls == AUTOTUNE
    assert fused((2, True, "thread"), (2, False, "thread")) is None  # deterministic differs
    assert fused((2, None, "thread"), (2, None, "process")) is None  # executors differ


def test_a_seeded_pipeline_moves_an_impure_inline_stage_onto_processes_only():
    seeded = Options(seed=3)
    onto_threads = tp.range(4).map(double).map(double, 2, executor="thread")
    assert fuse(_node(onto_threads), seeded, _any) is None
    assert fuse(_node(onto_threads), Options(), _any) is not None
    onto_processes = tp.range(4).map(double).map(double, 2, executor="process")
    assert fuse(_node(onto_processes), seeded, _any) is not None
    pure = tp.range(4).map(double, pure=True).map(double, 2, executor="thread")
    assert fuse(_node(pure), seeded, _any) is not None


def test_in_parallel_a_filter_can_only_be_the_last_stage():
    last = tp.range(4).map(double, 2, executor="thread").filter(even)
    assert stage_kinds(fuse(_node(last), Options(), _any)) == ("map", "filter")
    first = tp.range(4).filter(even).map(double, 2, executor="thread")
    assert fuse(_node(first), Options(), _any) is None
    assert fuse(_node(tp.range(4).filter(even).map(double)), Options(), _any) is not None


def test_only_pairs_the_pass_allows_fuse_and_each_fusion_leaves_a_note():
    ds = tp.range(4).map(double).filter(even).map(double)
    assert fuse(_node(ds), Options(), lambda outer, inner: "filter" not in outer + inner) is None
    notes = []
    root = apply_fusion(_node(ds), Options(), notes, "some_fusion", _any)
    assert stage_kinds(root) == ("map", "filter", "map")
    assert notes == [
        "some_fusion: map(double) + filter(even) -> one stage, inline",
        "some_fusion: map(double) + filter(even) + map(double) -> one stage, inline",
    ]

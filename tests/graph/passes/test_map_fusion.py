import os

import pytest
import torch

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites, running_root
from torchpipe.ops.fused import FusedMapNode

SEEDED = tp.Options(seed=11)


def noisy(x):
    return x + float(tp.rng().random())


def global_noise(x):
    return x + float(torch.rand(()))


def double(x):
    return 2 * x


def runs_in(x):
    return x, os.getpid()


def test_inline_maps_fuse_and_keep_seeds():
    ds = tp.range(20).map(noisy).map(global_noise).map(noisy).with_options(SEEDED)
    assert_pass_keeps_output(ds, "map_fusion")
    assert (
        rewrites(only(ds, "map_fusion"))["map_fusion"][-1]
        == "map(noisy) + map(global_noise) + map(noisy) -> one stage, inline"
    )


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_inline_map_moves_into_the_parallel_stage(executor):
    ds = tp.range(30).map(noisy, pure=True).map(double, 2, executor=executor).map(noisy, pure=True)
    ds = ds.with_options(tp.Options(seed=1))
    fused = running_root(only(ds, "map_fusion"))
    assert (
        isinstance(fused, FusedMapNode) and fused.num_parallel_calls == 2 and len(fused.stages) == 3
    )
    assert_pass_keeps_output(ds, "map_fusion")


def test_fused_functions_run_in_the_workers():
    ds = only(tp.range(8).map(double).map(runs_in, 2, executor="process"), "map_fusion")
    assert all(pid != os.getpid() for _, pid in ds)


def test_global_rng_seeding_blocks_moving_an_inline_map_onto_threads():
    ds = tp.range(5).map(global_noise).map(double, 2, executor="thread").with_options(SEEDED)
    assert "map_fusion" not in rewrites(only(ds, "map_fusion"))
    unseeded = tp.range(5).map(global_noise).map(double, 2, executor="thread")
    assert "map_fusion" in rewrites(only(unseeded, "map_fusion"))
    pure = tp.range(5).map(double, pure=True).map(double, 2, executor="thread").with_options(SEEDED)
    assert "map_fusion" in rewrites(only(pure, "map_fusion"))


@pytest.mark.parametrize(
    "a, b, fuses",
    [
        (
            dict(num_parallel_calls=2, executor="thread"),
            dict(num_parallel_calls=4, executor="auto"),
            True,
        ),
        (
            dict(num_parallel_calls=2, executor="thread"),
            dict(num_parallel_calls=2, executor="process"),
            False,
        ),
        (
            dict(num_parallel_calls=2, deterministic=False),
            dict(num_parallel_calls=2, deterministic=True),
            False,
        ),
        (dict(num_parallel_calls=tp.AUTOTUNE), dict(num_parallel_calls=3), True),
    ],
)
def test_parallel_settings_must_agree(a, b, fuses):
    ds = tp.range(12).map(double, **a).map(double, **b)
    on = only(ds, "map_fusion")
    assert ("map_fusion" in rewrites(on)) is fuses
    assert sorted(on) == [4 * x for x in range(12)]
    if fuses:
        fused = running_root(on)
        expected = (
            tp.AUTOTUNE if tp.AUTOTUNE in (a["num_parallel_calls"], b["num_parallel_calls"]) else 4
        )
        assert fused.num_parallel_calls == expected


def test_errors_name_the_original_stage():
    def bad(x):
        if x == 6:
            raise ValueError("three")
        return x

    ds = only(tp.range(6).map(double).map(bad, name="check"), "map_fusion")
    with pytest.raises(ValueError, match="three") as info:
        list(ds)
    assert "torchpipe stage check at element 3" in "".join(getattr(info.value, "__notes__", []))

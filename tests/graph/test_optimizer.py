"""The pass manager: order, switches, and output equal with every pass on or off."""

import pytest
import torch

import torchpipe as tp
from tests.graph.passes.toggle import unoptimized
from torchpipe.errors import CheckpointError
from torchpipe.graph.optimizer import PASSES
from torchpipe.options import OPTIMIZATIONS
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements


def test_passes_run_in_the_documented_order():
    assert tuple(p.NAME for p in PASSES) == OPTIMIZATIONS
    import torchpipe.graph.optimizer as optimizer

    documented = [
        line.split("``")[1]
        for line in optimizer.__doc__.splitlines()
        if line[:3].strip(". ").isdigit()
    ]
    assert documented == list(OPTIMIZATIONS)


def test_options_validate_pass_names_and_values():
    with pytest.raises(ValueError, match="unknown pass 'map_fuse'"):
        tp.Options(optimizations={"map_fuse": False})
    with pytest.raises(TypeError, match="must be a bool"):
        tp.Options(optimizations={"map_fusion": 0})
    with pytest.raises(TypeError, match="dict of pass name"):
        tp.Options(optimizations=["map_fusion"])


def test_switches_merge_along_the_graph():
    ds = (
        tp.range(4)
        .map(abs)
        .map(abs)
        .with_options(tp.Options(optimizations={"map_fusion": False}))
        .with_options(tp.Options(optimizations={"inject_prefetch": False}))
    )
    assert ds.options().optimizations == {"map_fusion": False, "inject_prefetch": False}
    assert (
        ds.explain(as_dict=True)["rewrites"] == {}
        and "Optimizations:\n  (none applied)" in ds.explain()
    )
    hash(ds.options())


class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((2, 3), float(i)), i % 5


def jitter(image, label):
    return image + float(tp.rng().random()), label


def keep(image, label):
    return label != 2


def pipelines():
    return {
        "images": tp.from_dataset(Images())
        .shuffle(16)
        .repeat(2)
        .take(-1)
        .map(jitter, 2, executor="process")
        .map(jitter)
        .filter(keep)
        .batch(6)
        .prefetch(0),
        "inline": tp.range(50)
        .skip(0)
        .map(lambda x: x * 3)
        .map(lambda x: x + tp.rng().integers(10))
        .filter(lambda x: x % 2 == 0)
        .filter(lambda x: x % 3 != 1)
        .shuffle(7)
        .repeat(1)
        .batch(4),
        "threads": tp.from_dataset(Images())
        .map(jitter, 3, executor="thread")
        .map(jitter, 2, executor="thread")
        .batch(8, drop_remainder=True),
        "vectorized": tp.range(30).map(float).map(lambda x: x * 2.0, batched=True).batch(7),
        "interleaved": tp.range(4)
        .interleave(lambda i: tp.range(i * 10, i * 10 + 5).map(lambda x: -x), 2)
        .map(lambda x: x + tp.rng().random(), pure=True),
    }


@pytest.mark.parametrize("name", sorted(pipelines()))
def test_every_pass_on_yields_what_every_pass_off_yields(name):
    ds = pipelines()[name].with_options(tp.Options(seed=21))
    assert_same_elements(list(ds), list(unoptimized(ds)))
    assert_checkpoint_roundtrip(ds, positions=range(0, 40, 3))


def test_a_checkpoint_from_other_optimizations_is_refused_clearly():
    ds = tp.range(10).map(abs).map(abs)
    it = iter(unoptimized(ds))
    next(it)
    state = it.state_dict()
    with iter(ds) as other, pytest.raises(CheckpointError, match="optimized differently"):
        other.load_state_dict(state)

import pytest
import torch

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites


def scale(x):
    return x * 0.5 + 1


def test_a_batched_map_runs_once_per_batch():
    calls = []

    def counted(x):
        calls.append(x.shape)
        return scale(x)

    ds = tp.range(10).map(lambda i: torch.full((3,), float(i))).map(counted, batched=True).batch(4)
    expected = assert_pass_keeps_output(ds, "vectorize", roundtrip=False)
    calls.clear()
    got = list(only(ds, "vectorize"))
    assert [tuple(s) for s in calls] == [(4, 3), (4, 3), (2, 3)]
    assert len(got) == len(expected) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert_pass_keeps_output(ds, "vectorize")


def test_only_declared_maps_before_a_plain_batch():
    plain = tp.range(6).map(float).map(scale).batch(2)
    assert "vectorize" not in rewrites(only(plain, "vectorize"))
    padded = tp.range(6).map(lambda i: torch.ones(i)).map(scale, batched=True).padded_batch(2)
    assert "vectorize" not in rewrites(only(padded, "vectorize"))


def test_explain_says_what_moved():
    text = only(tp.range(4).map(float).map(scale, batched=True).batch(2), "vectorize").explain()
    assert (
        "vectorize: map(fn=scale, batched=True) + batch(batch_size=2, drop_remainder=False)" in text
    )


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_flags_must_be_bools(bad):
    with pytest.raises(TypeError, match="batched must be a bool"):
        tp.range(3).map(scale, batched=bad)

"""``tp.explain`` of a DataLoader (loader/explain.py): its arguments as written and how it will run."""

import pytest

import torchpipe as tp


def test_tp_explain_describes_a_dataloader():
    import torch

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return i * i

    text = tp.explain(tp.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers="auto"))
    assert "dataset: Squares (a map-style dataset)" in text and "sampler: RandomSampler" in text
    assert (
        "(auto: usable cores to start)" in text
        and "worker processes forked from a zygote (resized by the autotuner" in text
    )
    assert "torch's own iterator (num_workers=0)" in tp.explain(tp.DataLoader(Squares()))
    assert "Optimizations:" in tp.explain(tp.DataLoader(tp.range(3).map(abs), batch_size=None))
    assert tp.explain(tp.range(3)) == tp.range(3).explain()
    with pytest.raises(TypeError, match="tp.Dataset or a DataLoader"):
        tp.explain([1, 2])

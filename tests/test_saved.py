"""tp.load: a saved dataset as a tp.Dataset read by index, its checkpoints, pickling, arguments."""

import pickle

import pytest
import torch

import torchpipe as tp
from torchpipe.saved import SavedDataset
from torchpipe.testing import assert_checkpoint_roundtrip


def test_random_access_bounds(tmp_path):
    tp.range(5).save(tmp_path / "s")
    loaded = tp.load(tmp_path / "s")
    assert loaded[-1] == 4 and loaded[0] == 0
    with pytest.raises(IndexError, match="index 5 out of range for 5 elements"):
        loaded[5]


def test_loaded_checkpoints_are_an_index(tmp_path):
    tp.range(12).map(lambda i: torch.tensor([i])).save(tmp_path / "s")
    loaded = tp.load(tmp_path / "s")
    assert_checkpoint_roundtrip(loaded)
    with iter(loaded) as it:
        next(it)
        assert it.state_dict()["pipeline"] == {"index": 1}
    shuffled = loaded.shuffle(12, seed=1).map(
        lambda x: x * 2, num_parallel_calls=2, executor="process"
    )
    assert sorted(int(x) for x in shuffled) == [2 * i for i in range(12)]
    assert pickle.loads(pickle.dumps(loaded))[3] == torch.tensor([3])


def test_load_takes_any_kind_of_path_and_checks_trusted(tmp_path):
    tp.range(3).map(lambda i: torch.full((2,), i)).save(tmp_path / "s")
    for path in (tmp_path / "s", str(tmp_path / "s"), bytes(tmp_path / "s")):
        loaded = tp.load(path)
        assert isinstance(loaded, SavedDataset) and len(loaded) == 3
    assert loaded.element_spec == loaded.records.element_spec
    assert loaded.element_spec["kind"] == "tensor" and loaded.element_spec["shape"] == [2]
    assert tp.load(tmp_path / "s", trusted=True).records.trusted
    with pytest.raises(TypeError, match="load: trusted must be a bool, got int"):
        tp.load(tmp_path / "s", trusted=1)
    with pytest.raises(TypeError, match="load: path must be a str or os.PathLike, got list"):
        tp.load([str(tmp_path / "s")])

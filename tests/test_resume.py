"""A checkpoint taken in one process resumes in another: the state is all that is needed."""

import os
import subprocess
import sys

import torch

from tests import resumes
from torchpipe.testing import assert_same_elements

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _split_pipeline(make, k):
    """The state after ``k`` elements of a pass of ``make()``, and the rest of that pass."""
    it = iter(make())
    try:
        for _ in range(k):
            next(it)
        return it.state_dict(), list(it)
    finally:
        it.close()


def _split_loader(k):
    """The loader's state after ``k`` batches of an epoch, and the rest of that epoch."""
    loader = resumes.loader()
    it = iter(loader)
    for _ in range(k):
        next(it)
    return loader.state_dict(), list(it)


def _resume_elsewhere(states, tmp_path):
    """Resume each of ``states`` in a new Python process (``tests.resumes``); what each yields."""
    states_path, out_path = tmp_path / "states.pt", tmp_path / "rest.pt"
    torch.save(states, states_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, "-m", "tests.resumes", str(states_path), str(out_path)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=50,
    )
    return torch.load(out_path)


def test_pipelines_and_a_dataloader_resume_in_a_new_process(tmp_path):
    states, rests = {}, {}
    for name, make in resumes.PIPELINES.items():
        states["pipeline", name], rests["pipeline", name] = _split_pipeline(make, 5)
    states["loader", None], rests["loader", None] = _split_loader(3)
    resumed = _resume_elsewhere(states, tmp_path)
    assert set(resumed) == set(states)
    for key, rest in rests.items():
        assert len(rest) > 0, key
        assert_same_elements(resumed[key], rest)

"""States saved by an earlier release (tests/fixtures/release_states.py) still load and resume exactly."""

import pytest
import torch

from tests.fixtures import release_states as release

SAVED = torch.load(release.FIXTURE, weights_only=False)


@pytest.mark.parametrize("name", sorted(release.PIPELINES))
def test_a_pipeline_state_from_the_earlier_release_resumes_exactly(name):
    it = iter(release.PIPELINES[name]())
    it.load_state_dict(SAVED["states"][name])
    rest = [release.plain(e) for e in it]
    assert rest and rest == SAVED["rests"][name]


def test_a_dataloader_state_from_the_earlier_release_resumes_exactly():
    loader = release.make_loader()
    loader.load_state_dict(SAVED["states"]["loader"])
    rest = [release.plain(e) for e in loader]
    assert rest and rest == SAVED["rests"]["loader"]

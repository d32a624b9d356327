"""A Ctrl-C that lands in a finalizer is raised at the training loop's next call, not lost."""

import weakref

import pytest
import torch

import torchpipe as tp


class Dies:
    """An element whose finalizer is where the KeyboardInterrupt lands (as a ring record's may)."""

    def __init__(self, x, interrupt):
        self.x = x
        if interrupt:
            weakref.finalize(self, _interrupted)


def _interrupted():
    raise KeyboardInterrupt


def element(x):
    return Dies(x, interrupt=x == 3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_pipeline_raises_an_interrupt_a_finalizer_swallowed():
    it = iter(tp.range(10).map(element))
    got = []
    with pytest.raises(KeyboardInterrupt):
        # dropping element 3 runs its finalizer, which Python lets swallow the interrupt
        for item in it:
            got.append(item.x)
            del item
    assert got in (
        [0, 1, 2, 3],
        [0, 1, 2, 3, 4],
    )  # at the next call after it died (a stage may hold the last one)


class Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dataloader_raises_an_interrupt_a_finalizer_swallowed():
    loader = tp.DataLoader(Batches(), batch_size=2, num_workers=1)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for batch in loader:
            got.append(batch.tolist())
            if len(got) == 2:
                weakref.finalize(Dies(0, False), _interrupted)  # dies at once: swallowed here
    assert got == [[0, 1], [2, 3]]

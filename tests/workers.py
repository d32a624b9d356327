"""A helper for tests that look at a pipeline as torch's DataLoader workers see it."""

import contextlib

import torch.utils.data._utils.worker as torch_worker


@contextlib.contextmanager
def as_torch_worker(index, num_workers, seed=1000):
    """This process, as torch's worker ``index`` of ``num_workers`` sees itself."""
    before = torch_worker._worker_info
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=index, num_workers=num_workers, seed=seed + index, dataset=None
    )
    try:
        yield
    finally:
        torch_worker._worker_info = before

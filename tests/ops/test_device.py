"""Device prefetch without CUDA: a clean no-op on the CPU, a clear error for CUDA."""

import pytest
import torch

import torchpipe as tp
from torchpipe.core.position_log import PositionLog
from torchpipe.ops.device import DevicePrefetcher, check_device, numbered
from torchpipe.testing import assert_checkpoint_roundtrip


def test_cpu_device_is_a_no_op():
    ds = tp.range(5).map(lambda x: torch.tensor([x])).to_device("cpu")
    assert [int(t) for t in ds] == list(range(5))
    assert_checkpoint_roundtrip(ds)
    it = iter([1, 2])
    assert list(DevicePrefetcher(it, "cpu")) == [1, 2]


def test_bad_devices_fail_at_the_call():
    with pytest.raises(ValueError, match="cpu or cuda"):
        check_device("meta")
    with pytest.raises(TypeError):
        tp.range(3).to_device("cpu", buffer_size=1.5)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            tp.range(3).to_device("cuda")


def test_the_copy_threads_input_ends_cleanly():
    # the copy thread pulls numbered elements from a generator: the input's end must end it,
    # not escape it as "generator raised StopIteration" (PEP 479)
    log = PositionLog(iter(tp.range(3)))
    assert list(numbered(log)) == [(0, 0), (1, 1), (2, 2)]

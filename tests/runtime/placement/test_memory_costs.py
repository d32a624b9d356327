"""What memory costs on this machine: a first-touch page fault and a byte copied, measured once."""

import mmap
import sys

import numpy as np
import pytest

from torchpipe.runtime.placement import memory_costs


def test_the_rates_are_measured_once_and_plausible():
    fault_s, byte_s = memory_costs.calibrate()
    assert 1e-8 < fault_s < 1e-3  # 10 ns .. 1 ms a page
    assert 1 / 1e12 < byte_s < 1 / 1e7  # 10 MB/s .. 1 TB/s
    assert memory_costs.calibrate() == (fault_s, byte_s)
    assert memory_costs.fault_seconds() == fault_s and memory_costs.byte_seconds() == byte_s


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="page faults are counted per thread on Linux"
)
def test_a_thread_counts_the_pages_it_faults_in_and_only_reused_ones_are_a_cold_start():
    with mmap.mmap(-1, 8 << 20) as fresh:  # 8 MiB the process never had
        before = memory_costs.thread_faults()
        np.frombuffer(fresh, np.uint8)[:: memory_costs.PAGE] = 1
        faulted = memory_costs.thread_faults() - before
    assert faulted >= 8  # a fault a page, or one per huge page where the kernel gives those
    assert memory_costs.cold_seconds(1000) == pytest.approx(1000 * memory_costs.fault_seconds())
    # blocks above the largest mmap threshold are mapped afresh for every result: those faults stay
    big = memory_costs.MMAP_THRESHOLD_MAX * 2
    assert memory_costs.cold_seconds(big // memory_costs.PAGE, steady_bytes=big) == 0.0
    assert memory_costs.cold_seconds(0) == 0.0

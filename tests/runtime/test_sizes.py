"""What an element weighs: element_bytes over tensors, arrays, blobs, strings and containers."""

import numpy as np
import torch

from torchpipe.runtime.sizes import element_bytes


def test_an_elements_bytes_count_its_tensors_arrays_bytes_and_strings():
    batch = {
        "id": ["ab", "cd"],
        "payload": [b"x" * 1000, b"y" * 24],
        "x": torch.zeros(4),
        "n": np.zeros(2, np.int64),
        "meta": {"tags": [["a"], ["bc"]], "len": 3},
    }
    assert element_bytes(batch) == 4 + 1024 + 16 + 16 + 3
    assert element_bytes(None) == 0 and element_bytes([]) == 0


def test_a_column_of_mixed_types_and_other_leaves_are_weighed_one_by_one():
    assert element_bytes(["ab", b"cd", bytearray(3)]) == 7
    assert element_bytes((torch.zeros(2, dtype=torch.uint8), 5, 1.5, object())) == 2
    assert element_bytes(torch.zeros(4, 4)[:, 0]) == 16  # a view weighs what it shows

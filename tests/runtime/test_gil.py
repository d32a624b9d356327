import time

import numpy as np

from torchpipe.runtime.gil import gil_free_fraction, steady_gil_free_fraction


def python_loop():
    total = 0
    for i in range(300_000):
        total += i
    return total


def test_python_code_holds_the_gil_and_sleeping_releases_it():
    result, held_free, seconds = gil_free_fraction(python_loop)
    assert result == sum(range(300_000)) and seconds > 0
    _, sleep_free, _ = gil_free_fraction(lambda: time.sleep(0.03))
    assert held_free < 0.5 < sleep_free


def test_numpy_work_mostly_releases_the_gil():
    a = np.random.default_rng(0).random((300, 300))
    _, free, _ = gil_free_fraction(lambda: [a @ a for _ in range(20)])
    _, held, _ = gil_free_fraction(python_loop)
    assert free > held


def test_the_steady_fraction_is_the_least_disturbed_of_separate_calls():
    calls = iter([python_loop, lambda: time.sleep(0.02), python_loop])
    results, free, seconds = steady_gil_free_fraction(lambda: next(calls)(), 3)
    assert results == [sum(range(300_000)), None, sum(range(300_000))] and seconds > 0.02
    assert free > 0.5  # calls that held the GIL throughout (as if disturbed) do not decide
    _, held, _ = steady_gil_free_fraction(python_loop, 3)
    assert held < 0.5

"""The allow-list of ``tp.add_safe_globals``, put back after every test of a module that imports
:func:`restore_safe_globals` (an autouse fixture)."""

import pytest

import torchpipe as tp


@pytest.fixture(autouse=True)
def restore_safe_globals():
    before = tp.get_safe_globals()
    yield
    tp.clear_safe_globals()
    tp.add_safe_globals(before)

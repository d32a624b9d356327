"""Finding a stage in a running pipeline: its iterator (white-box tests) or its stats (tests only)."""

from torchpipe.testing import find_stage

__all__ = ["find_stage", "stage_stats"]


def stage_stats(it, name):
    """The ``it.stats()`` entry of the first stage (root first) whose name starts with ``name``."""
    for stage in it.stats():
        if stage["stage"].startswith(name):
            return stage
    raise AssertionError(f"no stage {name!r} in the stats")

"""Finding a stage in a running pipeline: its iterator (white-box tests) or its stats (tests only)."""


def find_stage(it, kind):
    """The first iterator of type ``kind`` in the tree of ``it`` (a started pipeline iterator)."""
    stack = [it._tree]
    while stack:
        node = stack.pop()
        if isinstance(node, kind):
            return node
        stack.extend(node.children())
    raise AssertionError(f"no {kind.__name__} in the tree")


def stage_stats(it, name):
    """The ``it.stats()`` entry of the first stage (root first) whose name starts with ``name``."""
    for stage in it.stats():
        if stage["stage"].startswith(name):
            return stage
    raise AssertionError(f"no stage {name!r} in the stats")

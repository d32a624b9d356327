"""Finding an iterator of a given kind in a running pipeline's tree (tests only)."""


def find_stage(it, kind):
    """The first iterator of type ``kind`` in the tree of ``it`` (a started pipeline iterator)."""
    stack = [it._tree]
    while stack:
        node = stack.pop()
        if isinstance(node, kind):
            return node
        stack.extend(node.children())
    raise AssertionError(f"no {kind.__name__} in the tree")

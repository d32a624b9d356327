"""core.node.walk: the one graph walker, in its two orders."""

from torchpipe.core.node import Node, walk


class Op(Node):
    """A node that is only its name and its inputs."""

    def __init__(self, kind, *inputs):
        super().__init__(*inputs)
        self.kind = kind

    def build(self, ctx):
        raise AssertionError("a walk builds nothing")


def _kinds(nodes):
    return [node.kind for node in nodes]


def test_walk_lists_each_node_before_its_inputs_as_often_as_it_is_reached():
    shared = Op("source")
    nodes = walk(Op("zip", Op("map", shared), shared))
    assert _kinds(nodes) == ["zip", "map", "source", "source"]
    assert nodes[2] is nodes[3] is shared


def test_walk_inputs_first_lists_each_node_after_its_inputs_once():
    shared = Op("source")
    root = Op("zip", Op("map", shared), Op("take", shared))
    assert _kinds(walk(root, inputs_first=True)) == ["source", "map", "take", "zip"]


def test_walk_goes_deeper_than_the_recursion_limit():
    node = Op("source")
    for _ in range(3000):
        node = Op("map", node)
    assert len(walk(node)) == len(walk(node, inputs_first=True)) == 3001

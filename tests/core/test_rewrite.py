"""Copy-on-write rewriting of a node graph: with_inputs, with_attrs, rewrite_bottom_up."""

from torchpipe.core.node import Node
from torchpipe.core.rewrite import rewrite_bottom_up, with_attrs, with_inputs


class Op(Node):
    """A node that is only its name and its inputs."""

    def __init__(self, kind, *inputs):
        super().__init__(*inputs)
        self.kind = kind

    def build(self, ctx):
        raise AssertionError("a rewrite builds nothing")


def _shape(node):
    return (node.kind, *map(_shape, node.inputs))


def test_with_inputs_copies_a_node_only_when_its_inputs_differ():
    a, b = Op("a"), Op("b")
    node = Op("m", a)
    assert with_inputs(node, (a,)) is node
    copied = with_inputs(node, (b,))
    assert copied is not node and copied.inputs == (b,) and copied.kind == "m"
    assert node.inputs == (a,)  # the graph as written is untouched
    assert with_inputs(node, (a, b)).inputs == (a, b)


def test_with_attrs_sets_them_on_a_copy():
    node = Op("m", Op("a"))
    copied = with_attrs(node, kind="n", extra=3)
    assert (copied.kind, copied.extra, copied.inputs) == ("n", 3, node.inputs)
    assert node.kind == "m" and not hasattr(node, "extra")


def test_a_rule_that_changes_nothing_leaves_the_graph_as_it_is():
    root = Op("b", Op("a", Op("s")))
    assert rewrite_bottom_up(root, lambda node: None) is root


def test_inputs_are_rewritten_before_their_consumers_and_only_changed_paths_are_copied():
    source, other = Op("s"), Op("t")
    left, right = Op("x", source), Op("keep", other)
    root = Op("zip", left, right)
    seen = []

    def rule(node):
        seen.append(node.kind)
        return Op("y", *node.inputs) if node.kind == "x" else None

    new = rewrite_bottom_up(root, rule)
    assert seen == ["s", "x", "t", "keep", "zip"]
    assert _shape(new) == ("zip", ("y", ("s",)), ("keep", ("t",)))
    assert new is not root and new.inputs[1] is right and new.inputs[0].inputs[0] is source
    assert _shape(root) == ("zip", ("x", ("s",)), ("keep", ("t",)))


def test_a_shared_node_is_rewritten_once_and_stays_shared():
    shared = Op("x", Op("s"))
    root = Op("zip", shared, Op("m", shared))
    calls = []

    def rule(node):
        calls.append(node.kind)
        return Op("y", *node.inputs) if node.kind == "x" else None

    new = rewrite_bottom_up(root, rule)
    assert calls.count("x") == 1 and calls.count("s") == 1
    assert new.inputs[0] is new.inputs[1].inputs[0] and new.inputs[0].kind == "y"


def test_a_replacement_is_not_offered_to_the_rule_again():
    # fusing three maps takes two steps: the inner pair, then the outer map onto that
    offered = []

    def fuse(node):
        offered.append(node.kind)
        inner = node.inputs[0] if node.inputs else None
        if node.kind.startswith("map") and inner is not None and inner.kind.startswith("map"):
            return Op(f"{inner.kind}+{node.kind}", *inner.inputs)
        return None

    root = Op("map3", Op("map2", Op("map1", Op("s"))))
    assert _shape(rewrite_bottom_up(root, fuse)) == ("map1+map2+map3", ("s",))
    assert offered == ["s", "map1", "map2", "map3"]

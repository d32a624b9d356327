import torchpipe as tp


def test_explain_shows_every_op_with_params_root_first():
    ds = (tp.range(100).shuffle(10, seed=3).map(abs, num_parallel_calls=2).batch(8, drop_remainder=True)
          .with_options(tp.Options(seed=1)))
    lines = ds.explain().splitlines()
    assert lines[0] == "Pipeline as written (root first):"
    ops = [line.strip().lstrip("└├─│ ") for line in lines[1:6]]
    assert ops[0].startswith("with_options(") and ops[-1] == "range(start=0, stop=100, step=1)"
    assert any(op.startswith("map(fn=abs, num_parallel_calls=2") for op in ops)
    assert "Cardinality: 12" in lines and "Options: Options(seed=1)" in lines


def test_explain_draws_multi_input_graphs_as_a_tree():
    ds = tp.range(3).concatenate(tp.range(4).map(abs))
    text = ds.explain()
    assert "├─ range(start=0, stop=3, step=1)" in text
    assert "└─ map(fn=abs)" in text and "   └─ range(start=0, stop=4, step=1)" in text

import torchpipe as tp


def test_explain_shows_every_op_with_params_root_first():
    ds = (
        tp.range(100)
        .shuffle(10, seed=3)
        .map(abs, num_parallel_calls=2)
        .batch(8, drop_remainder=True)
        .with_options(tp.Options(seed=1))
    )
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


def test_explain_shows_what_each_pass_did_and_the_plan_that_runs():
    ds = (
        tp.range(50)
        .map(abs)
        .map(float)
        .take(-1)
        .filter(lambda x: x > 3)
        .map(abs, 2, executor="thread")
        .batch(4)
    )
    text = ds.explain()
    written, rest = text.split("Optimizations:")
    notes, running = rest.split("As it will run:")
    assert "take(count=-1)" in written and "take" not in running
    assert "noop_elimination: take(count=-1) -> removed" in notes
    assert "map_fusion: map(abs) + map(float) -> one stage, inline" in notes
    assert (
        "map_batch_fusion: batch(batch_size=4, drop_remainder=False) -> fused into map(fn=abs"
        in notes
    )
    first = running.strip().splitlines()[0]
    assert first.startswith("map(fn=abs, num_parallel_calls=2") and "+ batch(batch_size=4" in first


def test_explain_shows_the_values_the_autotuner_chose_for_the_latest_pass():
    ds = (
        tp.range(10_000)
        .map(lambda x: x, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .prefetch(tp.AUTOTUNE)
    )
    assert "Autotuned" not in ds.explain()
    it = iter(ds)
    next(it)
    text = ds.explain()
    values = it.tuned_values()
    assert "Autotuned (latest pass, now):" in text
    assert all(f"{name} = {value}" in text for name, value in values.items()) and len(values) == 2
    it.close()
    del it
    assert "Autotuned (last pass, at its end):" in ds.explain()  # until a new pass starts
    fresh = iter(ds)
    assert "Autotuned" not in ds.explain()
    del fresh


def test_explain_after_the_loop_shows_what_the_last_pass_chose():
    ds = (
        tp.range(3000)
        .map(lambda x: x, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .prefetch(tp.AUTOTUNE)
    )
    it = iter(ds)
    for _ in it:
        pass
    values = it.tuned_values()  # the tuner stopped with the pass's end: these are final
    del it  # as a for loop drops its iterator
    text = ds.explain()
    assert "Autotuned (last pass, at its end):" in text and len(values) == 2
    assert all(f"{name} = {value}" in text for name, value in values.items())


def test_explain_as_dict_holds_the_texts_facts():
    ds = tp.range(4).map(abs).map(abs).take(-1)
    facts = ds.explain(as_dict=True)
    assert list(facts["rewrites"]) == [
        "noop_elimination",
        "map_fusion",
        "inject_prefetch",
    ]  # in order applied
    text = ds.explain()
    assert all(
        f"{name}: {what}" in text for name, notes in facts["rewrites"].items() for what in notes
    )
    written, run = facts["as_written"], facts["as_run"]
    assert (written["op"], written["label"], written["inputs"][0]["label"]) == (
        "take",
        "take(count=-1)",
        "map(fn=abs)",
    )
    assert [run["op"], run["inputs"][0]["op"], run["inputs"][0]["inputs"][0]["op"]] == [
        "prefetch",
        "fused_map",
        "range",
    ]
    assert (facts["cardinality"], facts["options"], facts["tuned"], facts["tuned_now"]) == (
        4,
        tp.Options(),
        {},
        False,
    )


def test_explain_as_dict_gives_the_values_the_autotuner_chose():
    ds = (
        tp.range(10_000)
        .map(lambda x: x, num_parallel_calls=tp.AUTOTUNE, executor="thread")
        .prefetch(tp.AUTOTUNE)
    )
    it = iter(ds)
    next(it)
    facts = ds.explain(as_dict=True)
    assert facts["tuned"] == it.tuned_values() and len(facts["tuned"]) == 2 and facts["tuned_now"]
    it.close()
    del it
    assert ds.explain(as_dict=True)["tuned_now"] is False  # where the last pass left them

import torchpipe as tp
from tests.graph.passes.toggle import assert_pass_keeps_output, only, rewrites


def noisy(x):
    return x + tp.rng().random()


def test_a_synchronous_last_op_gets_a_prefetch_with_the_same_output():
    ds = tp.range(30).shuffle(8).map(noisy).batch(4).with_options(tp.Options(seed=3))
    assert_pass_keeps_output(ds, "inject_prefetch")
    it = iter(only(ds, "inject_prefetch"))
    next(it)
    root = it.stats()[0]
    # the root stage, a prefetch(tp.AUTOTUNE): inline until a thread measures faster
    assert root["stage"] == "prefetch" and root["executor"] == "inline"
    assert root["knobs"] == {"prefetch.buffer_size": 2}
    it.close()


def test_nothing_is_added_after_an_asynchronous_op():
    for ds in (
        tp.range(5).prefetch(2),
        tp.range(5).map(abs, 2),
        tp.range(5).map(abs).with_options(tp.Options()).prefetch(1),
    ):
        assert "inject_prefetch" not in rewrites(only(ds, "inject_prefetch"))


def test_a_checkpoint_loads_with_or_without_the_injected_prefetch():
    ds = tp.range(10).map(noisy).with_options(tp.Options(seed=1))
    plain = iter(only(ds))
    for _ in range(4):
        next(plain)
    state = plain.state_dict()
    with iter(only(ds, "inject_prefetch")) as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == list(only(ds))[4:]

"""Every op the autotuner models as a pool or a buffer implements the whole ``Tunable`` interface."""

import inspect

import torchpipe as tp
from torchpipe.autotune.live import build_model, look, start_look
from torchpipe.autotune.tunable import BUFFER, POOL, Tunable
from torchpipe.core.iterator import Iterator
from torchpipe.core.tunable import WeakStage
from torchpipe.loader.workers import WorkerIterator
from torchpipe.ops.interleave.interleave import InterleaveIterator
from torchpipe.ops.parallel_map import ParallelMapIterator
from torchpipe.ops.prefetch import PrefetchIterator
from torchpipe.testing import stages


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_pool_and_buffer_op_implements_the_interface():
    tunable = [cls for cls in _subclasses(Tunable) if cls.__module__.startswith("torchpipe.")]
    # a DataLoader's batches: a stage that holds its iterator weakly, which answers for it
    (loader_stage,) = stages(iter(tp.DataLoader(range(4), num_workers="auto")))
    assert isinstance(loader_stage, WeakStage) and loader_stage.tuning_role == POOL
    for name in ("children", "knobs", "buffer_slots", "parallelism", "calls_in_processes"):
        assert callable(getattr(WorkerIterator, name)), name
    roles = {cls.tuning_role for cls in tunable if cls is not WeakStage}
    assert roles == {POOL, BUFFER}
    expected = {ParallelMapIterator, InterleaveIterator, PrefetchIterator, WeakStage}
    assert set(tunable) == expected
    for cls in tunable:
        assert not inspect.isabstract(cls), (
            f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
        )
    untuned = [
        cls
        for cls in _subclasses(Iterator)
        if getattr(cls, "tuning_role", None) and cls not in tunable
    ]
    assert not untuned, (
        f"{untuned} have a tuning role but do not declare Tunable: the autotuner would not see them"
    )


def test_the_model_of_running_interleaves_maps_and_prefetches_builds():
    for executor in ("thread", "process", "auto"):
        ds = tp.range(40).interleave(
            lambda x: tp.range(3), cycle_length=2, num_parallel_calls=2, executor=executor
        )
        ds = ds.map(lambda x: x + 1, tp.AUTOTUNE).prefetch(tp.AUTOTUNE)
        it = iter(ds.with_options(tp.Options(autotune=tp.AutotuneOptions(enabled=False))))
        start = start_look()
        out = [next(it) for _ in range(30)]
        root = stages(it)[0]
        model = build_model(root, start, look(root, 0.0))
        assert model.stages and out
        it.close()

"""The pass manager: rewrites a pipeline graph with the static passes, in a fixed order.

Order (each pass sees what the ones before it made):

1. ``noop_elimination``: drop take(-1), skip(0), repeat(1), prefetch(0), shard(1, 0).
2. ``shuffle_repeat_fusion``: shuffle(...).repeat(n) as one op.
3. ``vectorize``: map(fn, batched=True).batch(n) -> batch(n).map(fn).
4. ``map_parallelization``: a sequential map of a pure function -> parallel, AUTOTUNE.
5. ``map_fusion``: adjacent maps -> one stage.
6. ``filter_fusion``: adjacent filters -> one stage.
7. ``map_filter_fusion``: map then filter -> one stage.
8. ``source_pushdown``: from_dataset fetched inside a parallel map's workers.
9. ``record_pushdown``: an interleave of indexable record files read by address inside a
   parallel map's workers.
10. ``map_batch_fusion``: parallel map then batch -> one task per batch.
11. ``inject_prefetch``: prefetch(AUTOTUNE) at the end when the last op is synchronous.

Every pass is on by default and can be switched off with
``tp.Options(optimizations={"map_fusion": False})``; none changes the elements a pipeline
yields (see docs/optimizer.md for what each assumes).
"""

from __future__ import annotations

from torchpipe.core.node import Node
from torchpipe.graph.passes import (
    filter_fusion,
    inject_prefetch,
    map_batch_fusion,
    map_filter_fusion,
    map_fusion,
    map_parallelization,
    noop_elimination,
    record_pushdown,
    shuffle_repeat_fusion,
    source_pushdown,
    vectorize,
)
from torchpipe.options import OPTIMIZATIONS, Options

PASSES = (
    noop_elimination,
    shuffle_repeat_fusion,
    vectorize,
    map_parallelization,
    map_fusion,
    filter_fusion,
    map_filter_fusion,
    source_pushdown,
    record_pushdown,
    map_batch_fusion,
    inject_prefetch,
)
assert tuple(p.NAME for p in PASSES) == OPTIMIZATIONS, (
    "options.OPTIMIZATIONS must list the passes in order"
)


def optimize(root: Node, options: Options) -> tuple[Node, list[str]]:
    """The graph that will run for ``root`` under ``options``, and a line per rewrite done."""
    notes: list[str] = []
    enabled = options.optimizations
    for graph_pass in PASSES:
        if enabled.get(graph_pass.NAME, True):
            root = graph_pass.apply(root, options, notes)
    return root, notes

"""``map``: a user function applied to every element, inline, on threads or in worker processes.

The nodes and the inline iterator live here; the parallel iterator, its executor choice and its
resizing in ``parallel_map.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchpipe.constants import AUTOTUNE
from torchpipe.core.arguments import (
    require_bool,
    require_callable,
    require_int,
    require_optional_bool,
)
from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator, PassThroughIterator
from torchpipe.core.node import AUTOTUNE_SYMBOL, BuildContext, Node, function_name
from torchpipe.core.state import check_int, check_state
from torchpipe.errors import CheckpointError
from torchpipe.ops.batch import BatchIterator, BatchNode
from torchpipe.ops.parallel_map import ParallelMapIterator
from torchpipe.ops.source_nodes import DatasetFetch
from torchpipe.runtime.codec import StackedTensor
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.placement.measure import prepare_measurements
from torchpipe.runtime.ray.executor import RayExecutor
from torchpipe.runtime.ray.executor import resolve as resolve_ray
from torchpipe.runtime.recycle import RecycledStack

EXECUTORS = ("auto", "thread", "process", "ray")
"""Accepted ``executor=`` names (and a ``tp.RayExecutor``, whose kind is ``"ray"``)."""


def executor_kind(executor: Any) -> str:
    """The executor an ``executor=`` argument names: a ``tp.RayExecutor`` is ``"ray"``."""
    return executor if isinstance(executor, str) else getattr(executor, "kind", "auto")


def check_map_args(
    fn: Any,
    num_parallel_calls: Any,
    deterministic: Any,
    executor: Any,
    name: Any,
    pure: Any,
    batched: Any,
) -> tuple[int | None, str | RayExecutor]:
    """Raise at ``map(...)`` for an argument of the wrong type or range.

    Returns:
        ``num_parallel_calls`` and ``executor`` as :class:`MapNode` takes them
        (see :func:`check_parallel_args`).
    """
    require_callable("map", "fn", fn)
    num_parallel_calls, executor = check_parallel_args(
        "map", num_parallel_calls, deterministic, executor
    )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"map: name must be a str, got {type(name).__name__}")
    require_bool("map", "pure", pure)
    require_bool("map", "batched", batched)
    return num_parallel_calls, executor


def check_parallel_args(
    op: str, num_parallel_calls: Any, deterministic: Any, executor: Any
) -> tuple[int | None, str | RayExecutor]:
    """Raise at a parallel stage's call (``map``, ``interleave``) for a ``num_parallel_calls``
    that is not None, ``tp.AUTOTUNE`` or an int >= 1, a ``deterministic`` not None or a bool, or
    an ``executor`` not in :data:`EXECUTORS` nor a ``tp.RayExecutor``.

    Returns:
        ``num_parallel_calls`` (on Ray, see :func:`_ray_parallelism`) and the executor, with
        ``"ray"`` as ``RayExecutor()`` (the node builds its pool with it).
    """
    if num_parallel_calls is not None and num_parallel_calls != AUTOTUNE:
        require_int(op, "num_parallel_calls", num_parallel_calls, minimum=1)
    require_optional_bool(op, "deterministic", deterministic)
    if not isinstance(executor, RayExecutor) and (
        not isinstance(executor, str) or executor not in EXECUTORS
    ):
        raise ValueError(
            f"{op}: executor must be one of {EXECUTORS} or a tp.RayExecutor, got {executor!r}"
        )
    return _ray_parallelism(op, executor, num_parallel_calls), resolve_ray(executor) or executor


def _ray_parallelism(op: str, executor: Any, num_parallel_calls: int | None) -> int | None:
    """The stage's ``num_parallel_calls`` where it runs on Ray: a ``RayExecutor``'s
    ``num_actors`` where set (an int ``num_parallel_calls`` must agree), else as given, which
    must then say how many run at once."""
    ray = resolve_ray(executor)
    if ray is None:
        return num_parallel_calls
    actors = ray.num_actors
    if actors is not None and num_parallel_calls not in (None, actors):
        raise ValueError(
            f"{op}: num_parallel_calls={num_parallel_calls} and RayExecutor(num_actors={actors}) "
            "disagree; give one of them"
        )
    parallel = ray.parallelism(num_parallel_calls)
    if parallel is None:
        raise ValueError(
            f"{op}: executor={executor!r} runs calls in parallel on Ray actors: give "
            "num_parallel_calls (an int or tp.AUTOTUNE) or RayExecutor(num_actors=...)"
        )
    return parallel


class MapNode(Node):
    """``fn(element)`` for every element."""

    kind = "map"
    holds_no_elements = True

    def __init__(
        self,
        input: Node,
        fn: Callable[..., Any],
        num_parallel_calls: int | None,
        deterministic: bool | None,
        executor: str | RayExecutor,
        name: str | None,
        pure: bool = False,
        batched: bool = False,
    ) -> None:
        super().__init__(input)
        self.fn = fn
        self.num_parallel_calls = num_parallel_calls
        self.deterministic = deterministic
        self.executor = executor
        self.name = name or f"map({function_name(fn)})"
        self.pure = pure or is_pure(fn)
        self.batched = batched
        # the pushed-down source's dataset (the optimizer's source_pushdown)
        self.dataset: Any = None
        if num_parallel_calls is not None and executor == "auto":
            prepare_measurements()  # the machine's side of the first decision, before the clock runs

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"fn": function_name(self.fn)}
        params.update(self.parallel_params())
        params.update((flag, True) for flag in ("pure", "batched") if getattr(self, flag))
        return params

    def label(self) -> str:
        text = super().label()
        text = text if self.name == f"map({function_name(self.fn)})" else f"{text} as {self.name!r}"
        return text + (" [source pushed down]" if self.dataset is not None else "")

    def parallel_params(self) -> dict[str, Any]:
        if self.num_parallel_calls is None:
            return {}
        parallel = (
            AUTOTUNE_SYMBOL if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
        )
        return {
            "num_parallel_calls": parallel,
            "deterministic": self.deterministic,
            "executor": self.executor,
        }

    def is_asynchronous(self) -> bool:
        return self.num_parallel_calls is not None

    def function(self, ctx: BuildContext, seed_globals: bool | None = None) -> Any:
        """What each element is passed through: an object with ``on_element(seq, element)``."""
        return UserFunction(self.fn, self.name, ctx, seed_globals)

    def build(self, ctx: BuildContext) -> Iterator:
        if self.num_parallel_calls is None:
            return MapIterator(self.name, ctx.build_input(self), self.function(ctx))
        source, fetch = self.source(ctx)
        return self.parallel_iterator(
            self.name, ctx, source, lambda fn, in_process: MapTask(fn, fetch)
        )

    def source(self, ctx: BuildContext) -> tuple[Iterator, DatasetFetch | None]:
        """The input iterator, and the fetch of the map-style dataset that runs next to ``fn``
        (set by the optimizer's source_pushdown pass, which replaced the source by its indices)."""
        return ctx.build_input(self), None if self.dataset is None else DatasetFetch(self.dataset)

    def parallel_iterator(
        self,
        name: str,
        ctx: BuildContext,
        source: Iterator,
        make_task: Callable[[UserFunction, bool], Any],
        memory: RecycledStack | None = None,
    ) -> ParallelMapIterator:
        """A parallel stage running ``make_task(fn, in_process)`` per input; ``ctx`` is this
        node's; ``memory``: where the tasks made in this process stack their batches."""
        parallelism = (
            usable_cpu_count() if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
        )
        assert parallelism is not None  # a parallel map's
        in_worker = make_task(self.function(ctx), True)
        tasks = {
            # as a worker: global RNGs seeded per element
            "inline": make_task(self.function(ctx), False),
            "thread": make_task(self.function(ctx, seed_globals=False), False),
            "process": in_worker,
            "ray": in_worker,  # a Ray actor runs what a worker process runs (pickled, not forked)
        }
        return ParallelMapIterator(
            name,
            source,
            tasks=tasks,
            parallelism=parallelism,
            deterministic=ctx.deterministic(self.deterministic),
            executor=self.executor,
            restart=ctx.options.restart_workers,
            tunable=self.num_parallel_calls == AUTOTUNE,
            learned=ctx.learned(),
            stall_s=ctx.options.stall_timeout,
            reproducible_globals=ctx.seeded,
            memory=memory,
        )


def pure(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare ``fn`` pure: its result depends only on its arguments (and ``tp.rng()``), and it
    has no side effects the caller relies on. Returns ``fn`` itself, marked.

    A sequential ``map`` of a pure function then runs in parallel (the optimizer's
    map_parallelization pass), and the pass may move it onto threads or worker processes.

    Raises:
        TypeError: if ``fn`` is not callable or cannot carry the mark (a builtin; wrap it
            in a def, or pass ``map(fn, pure=True)``).
    """
    if not callable(fn):
        raise TypeError(f"tp.pure expects a callable, got {type(fn).__name__}")
    try:
        fn.__torchpipe_pure__ = True  # type: ignore[attr-defined]  # a builtin refuses: caught below
    except (AttributeError, TypeError) as e:
        raise TypeError(f"tp.pure cannot mark {fn!r}; use map(fn, pure=True) instead") from e
    return fn


def is_pure(fn: Any) -> bool:
    """Whether ``fn`` was declared pure with ``@tp.pure``."""
    return getattr(fn, "__torchpipe_pure__", False) is True


class MapTask:
    """What a parallel map runs per element: fetch it by index when pushed down, call ``fn``.

    Worker processes inherit it through fork; Ray actors get it pickled, once per pool.
    """

    __slots__ = ("fn", "fetch")

    def __init__(self, fn: UserFunction, fetch: DatasetFetch | None = None) -> None:
        self.fn = fn
        self.fetch = fetch

    def start_worker(self, slot: int) -> None:
        self.fn.seed_worker(slot)

    def __call__(self, seq: int, payload: Any) -> Any:
        element = payload if self.fetch is None else self.fetch(payload)
        return self.fn.on_element(seq, element)


class MapBatchNode(Node):
    """A map followed by batch, run as one task per batch (map+batch fusion).

    Each task maps a whole batch and collates it where it ran (in a worker process, straight
    to shared memory): one dispatch and one transfer per batch; an error in one element fails
    its whole batch. A sequential map's runs on the consumer's thread, in order, with no call of
    torchpipe's between two elements, and gives what the unfused pair gives, errors included
    (:class:`MapBatchIterator`). Elements keep the sequence numbers (and so the seeds) they have
    unfused. Made by ``graph.fusion``.
    """

    kind = "map_batch"

    def __init__(self, map_node: MapNode, batch_node: BatchNode) -> None:
        super().__init__(*map_node.inputs)
        self.map_node = map_node
        self.batch_node = batch_node

    def label(self) -> str:
        return f"{self.map_node.label()} + {self.batch_node.label()}"

    def cardinality(self) -> int:
        return self.batch_node.cardinality()

    def is_asynchronous(self) -> bool:
        return self.map_node.is_asynchronous()

    def checkpoint_kinds(self) -> tuple[str, ...]:
        # a sequential map's fused state is the unfused pair's (MapBatchIterator)
        if self.map_node.num_parallel_calls is None:
            return (self.batch_node.kind, self.map_node.kind)
        return (self.kind,)

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return self.map_node.input_context(self.batch_node.input_context(ctx, 0), index)

    def build(self, ctx: BuildContext) -> Iterator:
        batch, map_node = self.batch_node, self.map_node
        map_ctx = batch.input_context(ctx, 0)  # where the map sits unfused: keeps its seeds
        name = f"{map_node.name}+{batch.name}"
        source, fetch = map_node.source(map_ctx)
        # In a worker the batch is stacked straight into the shared-memory record it is sent in;
        # here, into memory that earlier batches used.
        memory = batch.memory()
        here = batch.combiner(ctx, stack=memory or torch.stack)
        if map_node.num_parallel_calls is None:
            fn = map_node.function(map_ctx)
            return MapBatchIterator(name, source, fn, batch, here, memory)
        chunks = map_ctx.traced(
            BatchIterator(batch.name, source, batch.batch_size, batch.drop_remainder, _as_list)
        )
        combiners = {False: here, True: batch.combiner(ctx, stack=StackedTensor)}
        size = batch.batch_size

        def make_task(fn: UserFunction, in_process: bool) -> MapBatchTask:
            return MapBatchTask(
                fn, fetch, combiners[in_process], size, None if in_process else memory
            )

        return map_node.parallel_iterator(name, map_ctx, chunks, make_task, memory)


class MapBatchTask:
    """Maps a list of inputs (fetching them with ``__getitems__`` when it exists) and collates.

    With ``memory`` (in this process), each mapped element's large tensors are copied to their
    rows of the batch at once (see :class:`RecycledStack`).
    """

    __slots__ = ("fn", "fetch", "combine", "batch_size", "memory")

    def __init__(
        self,
        fn: UserFunction,
        fetch: DatasetFetch | None,
        combine: Callable[[int, list], Any],
        batch_size: int,
        memory: RecycledStack | None = None,
    ) -> None:
        self.fn = fn
        self.fetch = fetch
        self.combine = combine
        self.batch_size = batch_size
        self.memory = memory

    def start_worker(self, slot: int) -> None:
        self.fn.seed_worker(slot)

    def __call__(self, seq: int, payloads: list) -> Any:
        elements = payloads if self.fetch is None else self.fetch.many(payloads)
        first = seq * self.batch_size
        if self.memory is None or not self.memory.placing():
            return self.combine(seq, self.fn.on_elements(first, elements))
        with self.memory.rows(len(elements)) as rows:
            return self.combine(seq, self.fn.on_elements(first, elements, rows.place))


def _as_list(seq: int, elements: list) -> list:
    return elements


class MapIterator(PassThroughIterator):
    """Calls the function inline, one element at a time."""

    COUNTERS = ("seq",)

    def __init__(self, name: str, source: Iterator, fn: UserFunction) -> None:
        super().__init__(name, source)
        self._fn = fn
        self._seq = 0

    def next(self) -> Any:
        element = next(self._source)
        seq = self._seq
        self._seq = seq + 1
        return self._fn.on_element(seq, element)


class MapBatchIterator(Iterator):
    """A sequential map fused with its batch: a batch's inputs taken from the input at once, the
    function called over them in one loop on this thread, the results collated.

    It gives what the unfused map and batch give, errors included: an error in an element
    fails its batch (the elements mapped before it are dropped, as the unfused batch drops
    them) and the inputs after it start the next batch. Its checkpoint is the unfused pair's
    (``{"input": {"input": ..., "seq": elements}, "seq": batches}``), so each loads the other's,
    with the inputs left over from an error, where there are any, under ``"pending"``.
    """

    def __init__(
        self,
        name: str,
        source: Iterator,
        fn: UserFunction,
        batch: BatchNode,
        combine: Callable[[int, list], Any],
        memory: RecycledStack | None,
    ) -> None:
        super().__init__(name, source)
        self._source = source
        self._fn = fn
        self._size = batch.batch_size
        self._drop_remainder = batch.drop_remainder
        self._combine = combine
        self._memory = memory
        self._elements = 0  # elements mapped (the unfused map's count, and their seeds)
        self._seq = 0  # batches made
        self._pending: list = []  # inputs after an element that failed: the next batch's first

    def next(self) -> Any:
        inputs, self._pending = self._pending, []
        if len(inputs) < self._size:
            try:
                inputs = inputs + self._source.take(self._size - len(inputs))
            except StopIteration:
                if not inputs:
                    raise
        batch = self._map(inputs)
        if self._drop_remainder and len(inputs) < self._size:
            raise StopIteration
        self._seq += 1
        return batch

    def _map(self, inputs: list) -> Any:
        """The batch of ``inputs``, mapped and collated (into recycled rows where it places)."""
        first, memory = self._elements, self._memory
        done: list[Any] = []
        try:
            if memory is None or not memory.placing():
                return self._combine(self._seq, self._fn.on_elements(first, inputs, out=done))
            with memory.rows(len(inputs)) as rows:
                results = self._fn.on_elements(first, inputs, rows.place, out=done)
                return self._combine(self._seq, results)
        except BaseException:
            if len(done) < len(inputs):  # the element that raised; those after it come next
                self._pending = inputs[len(done) + 1 :]
            raise
        finally:
            self._elements = first + len(inputs) - len(self._pending)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "input": {"input": self._source.state_dict(), "seq": self._elements},
            "seq": self._seq,
        }
        if self._pending:
            state["pending"] = list(self._pending)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, "input", "seq")
        if not isinstance(state["input"], dict):
            raise CheckpointError(f"{self.name}: state['input'] must be the map's state, a dict")
        check_state(self.name, state["input"], "input", "seq")
        seq = check_int(self.name, state, "seq", minimum=0)
        elements = check_int(self.name, state["input"], "seq", minimum=0)
        pending = state.get("pending", [])
        if not isinstance(pending, list) or len(pending) >= self._size:
            raise CheckpointError(
                f"{self.name}: state['pending'] must be a list shorter than a batch"
            )
        self._source.load_state_dict(state["input"]["input"])
        self._seq, self._elements, self._pending = seq, elements, list(pending)

"""``flat_map`` and ``interleave``: a Dataset per input element, their elements merged in tf.data's
order by one iterator (:class:`InterleaveIterator`, ``iterator.py``) over a pool of readers: inline
(``readers.py``), on threads (``thread_readers.py``), in worker processes
(``process_readers.py``) or on Ray actors (``ray_readers.py``). With ``executor="auto"`` the readers
move between threads and processes while the pass runs (``placement.py``, docs/executors.md).

This module is the op: its nodes, their argument check, the cycle length ``AUTOTUNE`` means, and
which reader pools a pass starts with.

Resuming calls the user function again on the saved elements, with the same sequence numbers,
so the inner datasets (and their seeds) are rebuilt exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from torchpipe.constants import AUTOTUNE, UNKNOWN
from torchpipe.core.arguments import require_callable, require_int
from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node, function_name
from torchpipe.ops.interleave.iterator import InterleaveIterator
from torchpipe.ops.interleave.placement import ReaderPlacement
from torchpipe.ops.interleave.process_readers import ProcessReaders
from torchpipe.ops.interleave.ray_readers import RayReaders
from torchpipe.ops.interleave.readers import MAX_PARALLELISM, InlineReaders, InnerOpener, ReaderPool
from torchpipe.ops.interleave.thread_readers import ThreadReaders
from torchpipe.ops.map import check_parallel_args, executor_kind
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.placement.costs import INLINE, PROCESS, RAY, THREAD
from torchpipe.runtime.processes.pool import process_executor_supported

if TYPE_CHECKING:
    from torchpipe.runtime.ray.executor import RayExecutor

__all__ = [
    "AUTOTUNE_MIN_CYCLE",
    "FlatMapNode",
    "InterleaveIterator",
    "InterleaveNode",
    "autotune_cycle_length",
    "check_interleave_args",
]

AUTOTUNE_MIN_CYCLE = 16


def autotune_cycle_length() -> int:
    """``cycle_length=AUTOTUNE``: the usable cores, and at least ``AUTOTUNE_MIN_CYCLE``.

    tf.data takes the cores. That is too few streams for slow storage: the output takes its
    elements from the cycle in order, so a cycle of 2 delivers at the pace of 2 reads in flight
    until the readers ahead of it have filled (docs/autotune.md). At least 16 streams keep 16
    reads in flight, and the order is the same on every machine of up to 16 cores.
    """
    return max(usable_cpu_count(), AUTOTUNE_MIN_CYCLE)


def check_interleave_args(
    fn: Any,
    cycle_length: Any,
    block_length: Any,
    num_parallel_calls: Any,
    deterministic: Any,
    executor: Any,
) -> tuple[int | None, str | RayExecutor]:
    """Raise at ``interleave(...)`` for an argument of the wrong type or range.

    Returns:
        ``num_parallel_calls`` and ``executor`` as :class:`InterleaveNode` takes them
        (see :func:`~torchpipe.ops.map.check_parallel_args`).
    """
    require_callable("interleave", "fn", fn)
    if cycle_length is not None and cycle_length != AUTOTUNE:
        require_int("interleave", "cycle_length", cycle_length, minimum=1)
    require_int("interleave", "block_length", block_length, minimum=1)
    return check_parallel_args("interleave", num_parallel_calls, deterministic, executor)


class FlatMapNode(Node):
    """The elements of ``fn(element)`` for every input element, one inner dataset after another."""

    kind = "flat_map"

    def __init__(self, input: Node, fn: Callable[..., Any]) -> None:
        super().__init__(input)
        self.fn = fn
        self.name = f"flat_map({function_name(fn)})"

    def params(self) -> dict[str, Any]:
        return {"fn": function_name(self.fn)}

    def cardinality(self) -> int:
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        readers = InlineReaders(InnerOpener(UserFunction(self.fn, self.name, ctx), ctx))
        return InterleaveIterator(self.name, ctx.build_input(self), {INLINE: readers}, 1, 1)


class InterleaveNode(Node):
    """The elements of ``fn(element)`` for every input element, interleaved in tf.data's order."""

    kind = "interleave"

    def __init__(
        self,
        input: Node,
        fn: Callable[..., Any],
        cycle_length: int | None,
        block_length: int,
        num_parallel_calls: int | None,
        deterministic: bool | None,
        executor: str | RayExecutor = "auto",
    ) -> None:
        super().__init__(input)
        self.fn = fn
        self.cycle_length = cycle_length
        self.block_length = block_length
        self.num_parallel_calls = num_parallel_calls
        self.deterministic = deterministic
        self.executor = executor
        self.name = f"interleave({function_name(fn)})"

    def params(self) -> dict[str, Any]:
        cycle = "AUTOTUNE" if self.cycle_length in (None, AUTOTUNE) else self.cycle_length
        params: dict[str, Any] = {"fn": function_name(self.fn), "cycle_length": cycle}
        params["block_length"] = self.block_length
        if self.num_parallel_calls is not None:
            parallel = (
                "AUTOTUNE" if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
            )
            params.update(
                num_parallel_calls=parallel,
                deterministic=self.deterministic,
                executor=self.executor,
            )
        return params

    def cardinality(self) -> int:
        return UNKNOWN

    def is_asynchronous(self) -> bool:
        return self.num_parallel_calls is not None

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        cycle = (
            autotune_cycle_length() if self.cycle_length in (None, AUTOTUNE) else self.cycle_length
        )
        if self.num_parallel_calls is None:
            readers = InlineReaders(InnerOpener(UserFunction(self.fn, self.name, ctx), ctx))
            return InterleaveIterator(
                self.name, source, {INLINE: readers}, cycle, self.block_length
            )
        tunable = self.num_parallel_calls == AUTOTUNE
        parallelism = self.num_parallel_calls
        # a process (an actor) each costs memory: they start at the cores, threads at the cycle
        if tunable:
            each_own = executor_kind(self.executor) in (PROCESS, RAY)
            parallelism = usable_cpu_count() if each_own else min(cycle, MAX_PARALLELISM)
        pools = self._pools(ctx)
        placement = (
            ReaderPlacement(usable_cpu_count(), None if tunable else parallelism)
            if len(pools) > 1
            else None
        )
        return InterleaveIterator(
            self.name,
            source,
            pools,
            cycle,
            self.block_length,
            parallelism=parallelism,
            deterministic=ctx.deterministic(self.deterministic),
            tunable=tunable,
            placement=placement,
        )

    def _pools(self, ctx: BuildContext) -> dict[str, ReaderPool]:
        """The reader pools by kind, the one reading starts in first."""
        restart, stall_s, block = (
            ctx.options.restart_workers,
            ctx.options.stall_timeout,
            self.block_length,
        )
        processes = process_executor_supported()
        # as on processes, with the global RNGs seeded per element
        if executor_kind(self.executor) == RAY:
            opener = InnerOpener(UserFunction(self.fn, self.name, ctx), ctx)
            return {
                RAY: RayReaders(
                    self.name, opener, block, restart, stall_s, cast("RayExecutor", self.executor)
                )
            }
        if self.executor == "process" and processes:
            opener = InnerOpener(UserFunction(self.fn, self.name, ctx), ctx)
            return {PROCESS: ProcessReaders(self.name, opener, block, restart, stall_s)}
        # Pool threads share the global RNGs, so only tp.rng() is reproducible in fn here (and
        # with "auto", which may move the readers to processes part way, there too).
        opener = InnerOpener(UserFunction(self.fn, self.name, ctx, seed_globals=False), ctx)
        pools: dict[str, ReaderPool] = {THREAD: ThreadReaders(self.name, opener, block, stall_s)}
        if self.executor == "auto" and processes:
            pools[PROCESS] = ProcessReaders(
                self.name, opener, block, restart, stall_s, threads_in_workers=True
            )
        return pools

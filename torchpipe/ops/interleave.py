"""``flat_map`` and ``interleave``: a Dataset per input element, their elements merged in
tf.data's order, inline, on threads or in worker processes (see ``interleave_base.py``).

Resuming calls the user function again on the saved elements, with the same sequence numbers,
so the inner datasets (and their seeds) are rebuilt exactly.
"""

from __future__ import annotations

from typing import Any, Callable

from torchpipe.constants import AUTOTUNE, UNKNOWN
from torchpipe.ops.auto_interleave import AutoInterleaveIterator
from torchpipe.ops.base import BuildContext, Iterator, Node, UserFunction, function_name
from torchpipe.ops.interleave_base import _END, _ERROR, _FAILED, _VALUE, MAX_PARALLELISM, InnerOpener, InterleaveBase
from torchpipe.ops.process_interleave import ProcessInterleaveIterator
from torchpipe.ops.thread_interleave import ThreadInterleaveIterator
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.process_pool import process_executor_supported

AUTOTUNE_MIN_CYCLE = 16


def autotune_cycle_length() -> int:
    """``cycle_length=AUTOTUNE``: the usable cores, and at least ``AUTOTUNE_MIN_CYCLE``.

    tf.data takes the cores. That is too few streams for slow storage: the output takes its
    elements from the cycle in order, so a cycle of 2 delivers at the pace of 2 reads in flight
    until the readers ahead of it have filled (docs/autotune.md). At least 16 streams keep 16
    reads in flight, and the order is the same on every machine of up to 16 cores.
    """
    return max(usable_cpu_count(), AUTOTUNE_MIN_CYCLE)


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
        opener = InnerOpener(UserFunction(self.fn, self.name, ctx), ctx)
        return InterleaveIterator(self.name, ctx.build_input(self), opener, 1, 1)


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
        executor: str = "auto",
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
            parallel = "AUTOTUNE" if self.num_parallel_calls == AUTOTUNE else self.num_parallel_calls
            params.update(num_parallel_calls=parallel, deterministic=self.deterministic, executor=self.executor)
        return params

    def cardinality(self) -> int:
        return UNKNOWN

    def is_asynchronous(self) -> bool:
        return self.num_parallel_calls is not None

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        cycle = autotune_cycle_length() if self.cycle_length in (None, AUTOTUNE) else self.cycle_length
        if self.num_parallel_calls is None:
            opener = InnerOpener(UserFunction(self.fn, self.name, ctx), ctx)
            return InterleaveIterator(self.name, source, opener, cycle, self.block_length)
        tunable = self.num_parallel_calls == AUTOTUNE
        parallelism = self.num_parallel_calls
        if tunable:  # a process each costs memory: processes start at the cores, threads at the cycle
            parallelism = usable_cpu_count() if self.executor == "process" else min(cycle, MAX_PARALLELISM)
        block = self.block_length
        restart, stall_s = ctx.options.restart_workers, ctx.options.stall_timeout
        deterministic = ctx.deterministic(self.deterministic)
        if self.executor == "process" and process_executor_supported():
            opener = InnerOpener(UserFunction(self.fn, self.name, ctx), ctx)
            return ProcessInterleaveIterator(self.name, source, opener, cycle, block, parallelism, restart, tunable,
                                             deterministic=deterministic, stall_s=stall_s)  # fmt: skip
        # Pool threads share the global RNGs, so only tp.rng() is reproducible in fn here (and
        # with "auto", which may move the readers to processes part way, there too).
        opener = InnerOpener(UserFunction(self.fn, self.name, ctx, seed_globals=False), ctx)
        threads = ThreadInterleaveIterator(self.name, source, opener, cycle, block, parallelism, deterministic, tunable,
                                           stall_s=stall_s)  # fmt: skip
        if self.executor != "auto" or not process_executor_supported():
            return threads
        processes = ProcessInterleaveIterator(self.name, source, opener, cycle, block, parallelism, restart, tunable,
                                              threads_in_workers=True, deterministic=deterministic,
                                              stall_s=stall_s)  # fmt: skip
        return AutoInterleaveIterator(self.name, source, threads, processes)


class _Slot:
    """An open slot of the inline iterator; its inner iterator is built on first use."""

    __slots__ = ("element", "seq", "state", "iterator")

    def __init__(self, element: Any, seq: int, state: dict[str, Any] | None) -> None:
        self.element = element
        self.seq = seq
        self.state = state
        self.iterator: Iterator | None = None


class InterleaveIterator(InterleaveBase):
    """Runs the interleave inline: one input element, one inner element at a time.

    Args:
        name: the stage name, e.g. ``interleave(read_file)``.
        source: the input iterator.
        opener: builds an inner iterator from an input element.
        cycle_length: number of inner datasets open at once.
        block_length: consecutive elements taken from one before moving to the next.
    """

    def __init__(self, name: str, source: Iterator, opener: InnerOpener, cycle_length: int, block_length: int) -> None:
        super().__init__(name, source, opener, cycle_length, block_length)
        self._input_seq = 0

    def _fill_slot(self) -> None:
        seq = self._input_seq
        try:
            element = next(self._source)
        except StopIteration:
            self._end_of_input = True
            return
        except Exception:
            # An input error uses up a sequence number, as in the parallel iterator.
            self._input_seq = seq + 1
            raise
        self._input_seq = seq + 1
        self._put_slot(_Slot(element, seq, None))

    def _take(self, slot: _Slot) -> tuple[str, Any]:
        if slot.iterator is None:
            try:
                slot.iterator = self._opener(slot.element, slot.seq, slot.state)
            except Exception as e:
                return _FAILED, e
        try:
            return _VALUE, next(slot.iterator)
        except StopIteration:
            return _END, None
        except Exception as e:
            return _ERROR, e

    def _close_slot(self, slot: _Slot) -> None:
        if slot.iterator is not None:
            slot.iterator.close()

    def _input_state(self) -> tuple[dict[str, Any], int]:
        return self._source.state_dict(), self._input_seq

    def _load_input_state(self, state: dict[str, Any], seq: int) -> None:
        self._source.load_state_dict(state)
        self._input_seq = seq

    def _slot_state(self, slot: _Slot) -> dict[str, Any]:
        inner = slot.state if slot.iterator is None else slot.iterator.state_dict()
        return {self.ELEMENT: slot.element, self.SEQ: slot.seq, self.INNER: inner}

    def _restore_slot(self, element: Any, seq: int, inner: dict[str, Any] | None) -> _Slot:
        return _Slot(element, seq, inner)

    def children(self) -> list[Iterator]:
        inner = [slot.iterator for slot in self._slots if slot is not None and slot.iterator is not None]
        return [self._source, *inner]



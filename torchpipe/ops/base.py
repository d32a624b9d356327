"""The two halves of every op: the logical :class:`Node` and the physical :class:`Iterator`.

A ``Node`` is immutable: op parameters plus input nodes. ``Node.build(ctx)`` makes a fresh
``Iterator`` tree for one pass over the data. An ``Iterator`` implements only its own logic
(``next``, ``get_state``, ``set_state``); this base class owns lazy start, stats, the
closed-state error and the checkpoint plumbing.
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
import threading
import time
from collections import deque
from typing import Any, ClassVar

import numpy as np

from torchpipe.constants import UNKNOWN
from torchpipe.errors import CheckpointError, add_note
from torchpipe.ops.stats import IteratorStats
from torchpipe.options import Options
from torchpipe.randomness import call_seeded, enter_call, exit_call, mix_seed, seed_global_rngs
from torchpipe.runtime.tracing import STAGE, TraceLog

# Markers inside seed paths, so that (child 1) and (inner dataset of element 1) never collide.
_EPOCH_MARK = 1 << 62
_INNER_MARK = (1 << 62) + 1
_WORKER_MARK = (1 << 62) + 2
RANK_MARK = (1 << 62) + 3
"""Begins a rank's ``BuildContext.salt`` (``graph/distribute.py``)."""


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """Where in the pipeline an iterator is being built; the source of all its seeds.

    Attributes:
        seed: the pipeline seed (``Options.seed``, or one drawn for this iterator).
        seeded: whether the user set ``Options.seed``; only then are the global RNGs seeded
            before each user-function call in this process.
        epoch: how many iterators of this Dataset object were created before this one.
        options: the pipeline's merged options.
        path: the node's structural position (child indices from the root).
        iteration: repetition counters of enclosing ``repeat`` ops.
        memory: what earlier passes of the Dataset learned, by position (see :meth:`learned`).
        trace: the pass's trace log when it is traced (``Options(trace=...)``).
        salt: mixed into every seed drawn here: a rank's mark above the shard that splits a
            pipeline between ranks, so that ranks' shares are not shuffled and augmented alike
            (``graph/distribute.py``); empty elsewhere, where seeds are as they always were.
    """

    seed: int
    seeded: bool
    epoch: int
    options: Options
    path: tuple[int, ...] = ()
    iteration: tuple[int, ...] = ()
    memory: dict[tuple[int, ...], dict[str, Any]] | None = dataclasses.field(default=None, compare=False)
    trace: TraceLog | None = dataclasses.field(default=None, compare=False)
    salt: tuple[int, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a Ray actor (an interleave's readers there): without what earlier passes
        learned and the pass's trace, which belong to this process (inner datasets keep neither)."""
        return {**self.__dict__, "memory": None, "trace": None}

    def learned(self) -> dict[str, Any]:
        """What earlier passes of this Dataset learned about the stage at this position (the
        executor ``auto`` chose, the parallelism the autotuner settled on), for this pass to start
        from and to update. Inside a dataset a user function made, nothing is kept (a fresh dict):
        there is one per input element."""
        if self.memory is None or _INNER_MARK in self.path:
            return {}
        return self.memory.setdefault(self.path, {})

    def child(self, index: int) -> BuildContext:
        return dataclasses.replace(self, path=self.path + (index,))

    def repetition(self, count: int) -> BuildContext:
        return dataclasses.replace(self, iteration=self.iteration + (count,))

    def inner(self, seq: int) -> BuildContext:
        """The context of the dataset that a user function made from input element ``seq``."""
        return dataclasses.replace(self, path=self.path + (_INNER_MARK, seq))

    def build_input(self, node: Node, index: int = 0) -> Iterator:
        ctx = node.input_context(self, index)
        return ctx.traced(node.inputs[index].build(ctx))

    def traced(self, iterator: Iterator) -> Iterator:
        """``iterator`` (built with this context), recording into the pass's trace if it has one.

        Its stage gets a track named by its position in the graph, so the readers an interleave
        opens, one per input element, share one track."""
        if self.trace is not None and iterator.stats.trace is None:
            position = self.path[: self.path.index(_INNER_MARK) + 1] if _INNER_MARK in self.path else self.path
            order = (len(position), position)
            iterator.stats.trace = self.trace.track((STAGE, position, iterator.name), iterator.name, STAGE, order)
            if self.trace.every_element:
                iterator.stats.clock_all_s = -1.0
            if iterator.stats.calls is not None and iterator.stats.calls.trace is None:
                iterator.stats.calls.trace = self.trace.calls(iterator.name, order)
            for knob in iterator.knobs() if hasattr(iterator, "knobs") else ():
                knob.trace = self.trace.counter
                self.trace.counter(knob.name, knob.value)
        return iterator

    def stage_seed(self) -> int:
        """A seed for this position that changes every epoch and repetition."""
        return mix_seed(self.seed, *self.path, _EPOCH_MARK, self.epoch, *self.iteration, *self.salt)

    def op_seed(self, explicit: int | None, reshuffle: bool) -> int:
        """The seed of a random op: its own seed if given, else derived from its position.

        Args:
            explicit: the op's ``seed=`` argument.
            reshuffle: whether the op draws anew every epoch and repetition.
        """
        if explicit is None:
            base: tuple[int, ...] = (self.seed, *self.path)
        else:
            base = (explicit, self.options.seed or 0)
        if reshuffle:
            base += (_EPOCH_MARK, self.epoch, *self.iteration)
        return mix_seed(*base, *self.salt)

    def deterministic(self, explicit: bool | None) -> bool:
        return self.options.deterministic if explicit is None else explicit


class Node(abc.ABC):
    """A logical op: parameters and input nodes. Immutable and cheap to build."""

    kind: ClassVar[str]
    checkpoints_as_input: ClassVar[bool] = False
    """True for ops that leave no trace in a checkpoint (no iterator, or the input's state as
    their own); checkpoint fingerprints skip them."""

    SPEED_PARAMS: ClassVar[tuple[str, ...]] = ("num_parallel_calls", "deterministic", "executor", "pure", "batched")
    """Parameters that change how fast an op runs, or how the optimizer may run it, but not its
    elements: a checkpoint resumes across them (an inline map's state loads into a parallel one)."""

    def __init__(self, *inputs: Node) -> None:
        self.inputs: tuple[Node, ...] = inputs

    def params(self) -> dict[str, Any]:
        """The op's parameters, for ``explain()``."""
        return {}

    def fingerprint_params(self) -> dict[str, Any]:
        """The parameters that decide which elements the op yields, for the fingerprints of
        checkpoints and cache files (``ops/fingerprint.py``): :meth:`params` without
        :attr:`SPEED_PARAMS`, each function as the callable itself (``params()`` shows its name).
        """
        params = {key: value for key, value in self.params().items() if key not in self.SPEED_PARAMS}
        for key, value in params.items():
            attr = getattr(self, key, None)
            if isinstance(value, Symbol) and callable(attr) and value == function_name(attr):
                params[key] = attr
        return params

    def cardinality(self) -> int:
        """Number of elements, ``INFINITE`` or ``UNKNOWN`` (default: the first input's)."""
        return self.inputs[0].cardinality() if self.inputs else UNKNOWN

    def own_options(self) -> Options | None:
        """Options this node sets for the pipeline (only ``with_options`` has any)."""
        return None

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> Iterator:
        """A fresh iterator for one pass over this node's elements."""

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        """The context input ``index`` is built with when this node is built with ``ctx``.

        Nodes made by the optimizer override it so that the nodes they stand in for keep
        the contexts (and so the seeds) they have in the graph as written.
        """
        return ctx.child(index)

    def elided_context(self, ctx: BuildContext) -> BuildContext:
        """The context of this node's input when the optimizer removes the node itself."""
        return self.input_context(ctx, 0)

    def is_asynchronous(self) -> bool:
        """Whether the iterator computes ahead of its consumer (on threads or processes)."""
        return False

    def label(self) -> str:
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in self.params().items())
        return f"{self.kind}({body})"


class Symbol(str):
    """A parameter value shown bare in ``explain()`` (``AUTOTUNE``, not ``'AUTOTUNE'``)."""

    def __repr__(self) -> str:
        return str(self)


AUTOTUNE_SYMBOL = Symbol("AUTOTUNE")


def _fmt(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return function_name(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def function_name(fn: Any) -> str:
    """A readable name for a user function (``<lambda>``, a class name, ``partial(f)``)."""
    name = getattr(fn, "__name__", None)
    if name is None and hasattr(fn, "func"):
        return Symbol(f"partial({function_name(fn.func)})")
    return Symbol(name if name is not None else type(fn).__name__)


_NEW, _RUNNING, _CLOSED = range(3)


class Iterator(abc.ABC):
    """The physical, stateful iterator of one op.

    Subclasses implement :meth:`next` (raise ``StopIteration`` at the end), :meth:`get_state`
    and :meth:`set_state`, and optionally :meth:`start` (called once, before the first
    element), :meth:`shutdown` (release threads and buffers) and :meth:`children`.

    Args:
        name: the stage name used in errors and stats, e.g. ``map(decode)``.
        inputs: the input iterators this one owns.
    """

    _status = _NEW  # class default, so a subclass that skipped __init__ gets a clear error

    def __init__(self, name: str, *inputs: Iterator) -> None:
        self.name = name
        self.inputs: list[Iterator] = list(inputs)
        self.stats = IteratorStats()
        self._status = _NEW

    # -- what an op implements ------------------------------------------------------------
    @abc.abstractmethod
    def next(self) -> Any:
        """The next element; raises StopIteration at the end."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """A fresh (unaliased) dict from which :meth:`set_state` can resume."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`get_state`'s output; called before the first element only."""

    def skip(self) -> None:
        """Move past the next element without handing it over (StopIteration at the end).

        Sources that can seek override it to skip without reading (``shard`` uses it)."""
        next(self)

    def start(self) -> None:
        """Start background work; called once, just before the first element is asked for."""

    def prepare(self) -> None:
        """Fork worker processes' zygotes; runs right after the tree is built, before any thread.

        Overrides must call ``super().prepare()`` so the inputs are prepared too.
        """
        for child in self.children():
            child.prepare()

    def shutdown(self) -> None:
        """Stop background work and drop buffers; called once by :meth:`close`."""

    def children(self) -> list[Iterator]:
        """The iterators this one currently owns (closed with it, reported in stats)."""
        return self.inputs

    # -- what the base class does -----------------------------------------------------------
    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        if self._status != _RUNNING:
            self._begin()
        stats = self.stats
        if stats.unclocked:  # cheap elements are clocked one in a few (see IteratorStats.clocked)
            stats.unclocked -= 1
            element = self.next()
            stats.produced += 1
            return element
        t0, waited = time.perf_counter(), stats.wait_s
        element = self.next()
        stats.produced += 1
        t1 = time.perf_counter()
        stats.clocked(t1 - t0, stats.wait_s - waited)
        if stats.trace is not None:  # a traced pass records the elements it clocks
            stats.trace.span(t0, t1)
        return element

    def _begin(self) -> None:
        if self._status == _CLOSED:
            raise RuntimeError(f"{self.name}: iterator is closed")
        if not hasattr(self, "stats"):
            raise RuntimeError(f"{type(self).__name__}.__init__ did not call super().__init__()")
        self._status = _RUNNING
        self.start()

    def state_dict(self) -> dict[str, Any]:
        """This iterator's checkpoint: small, picklable, and unaliased with live state."""
        return self.get_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; only valid before the first element.

        Raises:
            RuntimeError: if the iterator already started.
            CheckpointError: if ``state`` is not a state of this op.
        """
        if self._status != _NEW:
            raise RuntimeError(f"{self.name}: load_state_dict() must come before the first element")
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.name}: expected a state dict, got {type(state).__name__}")
        try:
            self.set_state(state)
        except CheckpointError:
            raise
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{self.name}: malformed state ({e!r})") from e

    def close(self) -> None:
        """Stop background work and release resources; idempotent."""
        if self._status == _CLOSED:
            return
        self._status = _CLOSED
        try:
            self.shutdown()
        finally:
            for child in self.children():
                child.close()

    def all_stats(self) -> list[dict[str, Any]]:
        """Stats of this iterator and every iterator below it, root first."""
        out = [{"stage": self.name, **self.stats.as_dict()}]
        knobs = self.knobs() if hasattr(self, "knobs") else []  # ops the autotuner tunes have some
        if knobs:
            out[0]["knobs"] = {knob.name: knob.value for knob in knobs}
        for child in self.children():
            out.extend(child.all_stats())
        return out


class PassThroughIterator(Iterator):
    """Base of single-input ops whose state is the input's plus a few counters.

    ``COUNTERS`` names the counters; each lives in the attribute ``_<name>``.
    """

    INPUT = "input"
    COUNTERS: tuple[str, ...] = ()
    COUNTER_MINIMUM: int | None = 0
    """The least value an int counter may be loaded with (None: any)."""

    def __init__(self, name: str, source: Iterator) -> None:
        super().__init__(name, source)
        self._source = source

    def get_state(self) -> dict[str, Any]:
        state = {self.INPUT: self._source.state_dict()}
        state.update((key, getattr(self, "_" + key)) for key in self.COUNTERS)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, *self.COUNTERS)
        values = {key: self._checked_counter(state, key) for key in self.COUNTERS}
        self._source.load_state_dict(state[self.INPUT])
        for key, value in values.items():
            setattr(self, "_" + key, value)

    def _checked_counter(self, state: dict[str, Any], key: str) -> Any:
        """``state[key]``, which must have the type its counter started with (an int or a bool)."""
        current = getattr(self, "_" + key)
        if isinstance(current, bool):
            return check_bool(self.name, state, key)
        if isinstance(current, int):
            return check_int(self.name, state, key, minimum=self.COUNTER_MINIMUM)
        return state[key]


class UserFunction:
    """Calls a user function the way every stage does.

    Before each call it makes the element's seed current for ``tp.rng()`` and, when the
    pipeline has a seed, seeds the global RNGs. Exceptions keep their type and get a note
    naming the stage and the element's sequence number; a ``StopIteration`` escaping the
    function becomes a RuntimeError so it cannot silently end the pipeline.

    Args:
        fn: the user's callable.
        stage: the stage name, e.g. ``map(decode)``.
        ctx: the build context (source of the stage seed).
        seed_globals: whether to seed ``random``/numpy/torch before each call: ``None`` when
            the pipeline has a seed (inline calls and worker processes), False never (threads
            share them). Seeding costs about 10 us a call, so pipelines without a seed skip it;
            their worker processes get distinct streams from :meth:`seed_worker` instead.
    """

    __slots__ = ("fn", "stage", "_seed", "_seed_globals")

    def __init__(self, fn: Any, stage: str, ctx: BuildContext, seed_globals: bool | None = None) -> None:
        self.fn = fn
        self.stage = stage
        self._seed = ctx.stage_seed()
        self._seed_globals = ctx.seeded if seed_globals is None else seed_globals

    def __call__(self, seq: int, *args: Any) -> Any:
        prev = enter_call(self._seed, seq)
        try:
            if self._seed_globals:
                return call_seeded(mix_seed(self._seed, seq), self.fn, *args)
            return self.fn(*args)
        except StopIteration as e:
            raise RuntimeError(f"{self.stage} raised StopIteration at element {seq}") from e
        except Exception as e:
            add_note(e, f"raised in torchpipe stage {self.stage} at element {seq}")
            raise
        finally:
            exit_call(prev)

    @property
    def seeds_globals(self) -> bool:
        """Whether each call seeds the global RNGs (the pipeline has a seed)."""
        return self._seed_globals

    def seed_worker(self, slot: int) -> None:
        """In a new worker process: its own global RNG streams, unless calls seed them anyway
        (forked workers would otherwise all repeat the parent's streams)."""
        if not self._seed_globals:
            seed_global_rngs(mix_seed(self._seed, _WORKER_MARK, slot))

    def on_element(self, seq: int, element: Any) -> Any:
        """Call with ``element``, unpacking a plain tuple into positional arguments (tf.data)."""
        if type(element) is tuple:
            return self(seq, *element)
        return self(seq, element)


class PositionLog:
    """Input positions of the elements an asynchronous op has pulled but not yet delivered.

    Asynchronous ops (prefetch, parallel map, parallel interleave) run ahead of their
    consumer. Their checkpoint is the input's state just before the oldest undelivered element,
    plus the sequence numbers already delivered after it (non-deterministic order); in-flight
    elements are recomputed after a resume rather than saved. ``pull`` may run on a producer
    thread; everything else runs on the consumer's.

    Args:
        source: the input iterator; only ``pull`` touches it once started.
    """

    def __init__(self, source: Iterator) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._before: dict[int, dict[str, Any]] = {}
        self._order: deque[int] = deque()
        self._delivered_ahead: set[int] = set()
        self._skip: set[int] = set()
        self._next_seq = 0
        self._latest: dict[str, Any] | None = None

    def pull(self) -> tuple[int, Any, BaseException | None]:
        """Pull the next input element: ``(seq, element, error)``.

        A user error raised by the input is returned, not raised, so that it takes its place
        in the order. ``StopIteration`` propagates.
        """
        if self._latest is None:
            self._latest = self.source.state_dict()
        while True:
            before = self._latest
            error: BaseException | None = None
            element = None
            try:
                element = next(self.source)
            except StopIteration:
                self._latest = self.source.state_dict()
                raise
            except Exception as e:
                error = e
            after = self.source.state_dict()
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
                self._latest = after
                if seq in self._skip:
                    self._skip.discard(seq)
                    continue
                self._before[seq] = before
                self._order.append(seq)
            return seq, element, error

    def rebase(self) -> None:
        """The input was moved on without the log (nothing in flight): read its position afresh."""
        with self._lock:
            self._latest = None

    def delivered(self, seq: int) -> None:
        """Mark element ``seq`` as handed to the consumer."""
        with self._lock:
            del self._before[seq]
            if self._order[0] == seq:
                self._order.popleft()
                while self._order and self._order[0] in self._delivered_ahead:
                    self._delivered_ahead.discard(self._order.popleft())
            else:
                self._delivered_ahead.add(seq)

    def state_after(self, seq: int) -> dict[str, Any]:
        """The input's state right after element ``seq`` (pulled, not delivered) was pulled.

        For inputs pulled and delivered in order, as an inner reader's are (nothing skipped)."""
        with self._lock:
            return self._before.get(seq + 1, self._latest)

    def state(self) -> dict[str, Any]:
        with self._lock:
            if not self._order:
                if self._latest is None:
                    self._latest = self.source.state_dict()
                return {"input": self._latest, "seq": self._next_seq, "skip": sorted(self._skip)}
            oldest = self._order[0]
            skip = sorted(self._skip | self._delivered_ahead)
            return {"input": self._before[oldest], "seq": oldest, "skip": skip}

    def set_state(self, state: dict[str, Any], stage: str | None = None) -> None:
        """Resume at ``state``; ``stage`` names the op that owns this log in errors.

        Raises:
            CheckpointError: for a missing key or a value of the wrong type.
        """
        name = stage or f"the consumer of {self.source.name}"
        check_state(name, state, "input", "seq", "skip")
        seq = check_int(name, state, "seq", minimum=0)
        skip = state["skip"]
        if not isinstance(skip, (list, tuple)) or not all(_is_int(n) and n >= 0 for n in skip):
            raise CheckpointError(f"{name}: state['skip'] must be a list of sequence numbers, got {skip!r}")
        self.source.load_state_dict(state["input"])
        self._latest = state["input"]
        self._next_seq = seq
        self._skip = {int(n) for n in skip}


def check_state(name: str, state: dict[str, Any], *keys: str) -> None:
    """Raise CheckpointError unless ``state`` has ``keys``."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"{name}: state is missing {missing}; is it from another pipeline?")


def check_int(name: str, state: dict[str, Any], key: str, minimum: int | None = None,
              maximum: int | None = None) -> int:  # fmt: skip
    """``state[key]`` as an int.

    Raises:
        CheckpointError: naming the stage and the key, if the value is not an int (a bool or
            the text of a number is not) or lies outside ``[minimum, maximum]``.
    """
    value = state[key]
    if not _is_int(value):
        raise CheckpointError(f"{name}: state[{key!r}] must be an int, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"[{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}]"
        raise CheckpointError(f"{name}: state[{key!r}] is {value}, outside {bounds}")
    return int(value)


def check_bool(name: str, state: dict[str, Any], key: str) -> bool:
    """``state[key]`` as a bool.

    Raises:
        CheckpointError: naming the stage and the key, if the value is not a bool.
    """
    value = state[key]
    if not isinstance(value, (bool, np.bool_)):
        raise CheckpointError(f"{name}: state[{key!r}] must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))

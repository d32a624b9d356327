"""A compiled pipeline (``Plan``) and the root iterator that owns one pass over it."""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from torchpipe.autotune.autotuner import Autotuner, ConsumerClock, Decision, live_knobs
from torchpipe.autotune.live import Look, start_look
from torchpipe.autotune.report import PipelineStats, pipeline_stats
from torchpipe.autotune.tuner import Budget
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_int
from torchpipe.distributed.collectives import broadcast_seed
from torchpipe.distributed.context import RankInfo, worker_info
from torchpipe.distributed.rewrite import distribute
from torchpipe.distributed.workers import TorchWorker
from torchpipe.errors import CheckpointError
from torchpipe.graph.optimizer import optimize
from torchpipe.observe.tracing import TUNER, TraceLog, Track
from torchpipe.options import Options
from torchpipe.randomness import fresh_seed
from torchpipe.runtime import interrupts
from torchpipe.runtime.heap import hold_free
from torchpipe.runtime.recycle import delivered
from torchpipe.runtime.sizes import heap_bytes
from torchpipe.storage.fingerprint import describe_ops, ops_of

_FORMAT = 3
"""Version 3 names each op as written with its parameters (version 2 had only the kinds)."""


class Plan:
    """The graph as written, the graph that will run (after the static passes), the options.

    Args:
        root: the pipeline's root node.
        options: the pipeline's merged options.
        memory: what earlier passes learned, by stage position (the Dataset's; passes share it).
        worker: the torch DataLoader worker this process is, if any: the plan then yields its
            share alone, unless the pipeline or the code iterating it split the data by hand
            (``distributed/workers.py``).
        rank: the rank this process is, where the pipeline is split between ranks: the plan
            then yields the rank's share (with ``worker``, the worker's share of it;
            ``distributed/ranks.py``).

    Attributes:
        runtime_root: the root after the distribution rewrite (``distributed/rewrite.py``: the
            rank's or worker's share node) and ``graph.optimizer.optimize``.
        rewrites: a line per rewrite (the split, the passes), for ``explain()``.
        distribution: how the pipeline is split for this process (the whole where it is not).
        warning: what the pass warns of at its first element (None: nothing), where torchpipe
            cannot tell whether the user's code split the data between torch workers by hand.

    Raises:
        ValueError: for distribution options this pipeline cannot run with (``distributed/rewrite.py``).
    """

    def __init__(
        self,
        root: Node,
        options: Options,
        memory: dict[tuple[int, ...], dict[str, Any]] | None = None,
        worker: TorchWorker | None = None,
        rank: RankInfo | None = None,
    ) -> None:
        self.root = root
        self.options = options
        self.memory = memory
        self.worker = worker
        self.rank = rank
        self.distribution = distribute(root, options, worker, rank)
        self.warning = self.distribution.warning
        optimized, rewrites = optimize(self.distribution.root, options)
        self.runtime_root = self.distribution.equalized(optimized)
        self.rewrites = self.distribution.notes + rewrites
        # The split is part of what a checkpoint names: worker 0's state does not load in worker 1
        # (a rank's share node names its rank in its state instead, so that states can be resharded).
        written, run = (
            describe_ops(self.distribution.written),
            [kind for node in ops_of(self.runtime_root) for kind in node.checkpoint_kinds()],
        )
        self._fingerprint = written + ["->"] + run

    def fingerprint(self) -> list[str]:
        """Each op as written with its parameters, then the op kinds as run, depth first (a
        fresh list; ``storage/fingerprint.py``).

        A checkpoint only loads into a pipeline of the same ops and parameters, optimized the
        same way.
        """
        return list(self._fingerprint)

    def iterator(self, history: PassHistory) -> PipelineIterator:
        """A new pass, in the epoch ``history`` gives it."""
        return PipelineIterator(self, history)

    @property
    def salt(self) -> tuple[int, ...]:
        """What the seeds above a rank's split mix in (``BuildContext.salt``)."""
        return self.distribution.salt

    def pass_seed(self) -> int:
        """The seed of a new pass: ``Options.seed``; where ranks must draw alike, rank 0's fresh
        one (broadcast: a collective); in a torch worker the seed its DataLoader's workers share
        this epoch; else a fresh random one.

        Raises:
            RuntimeError: where ranks must draw alike but cannot talk (in a torch DataLoader
                worker, or without ``torch.distributed``) and the pipeline has no seed.
        """
        if self.options.seed is not None:
            return self.options.seed
        if self.distribution.shared_seed:
            if self.rank is None or not self.rank.connected:  # only a rank's split shares a seed
                raise RuntimeError(
                    "this pipeline is split between ranks below a random op (a shuffle), so every rank must draw "
                    f"the same seed, and {_cannot_talk()} to share one: give the pipeline "
                    "tp.Options(seed=...)"
                )
            return broadcast_seed(fresh_seed(), self.options.stall_timeout)
        return self.worker.seed if self.worker is not None else fresh_seed()

    def open_pass(self) -> Callable[[], None] | None:
        """Set up what one pass needs from the other ranks (their agreement on its end, where its
        length is not known ahead); returns what closes it, or None.

        Raises:
            RuntimeError: where that agreement is needed but the ranks cannot talk.
        """
        group = self.distribution.group
        if group is None:
            return None
        if self.rank is None or not self.rank.connected:  # only a rank's split needs an agreement
            raise RuntimeError(
                "this pipeline's length on each rank is not known ahead, so the ranks must agree where it ends "
                f"(DistributeOptions(uneven={self.options.distribute.uneven!r})), and {_cannot_talk()}: "
                "initialize torch.distributed, run it with tp.DataLoader(pipeline) rather than in torch "
                "DataLoader workers, or leave the lengths alone with DistributeOptions(uneven='allow')"
            )
        group.open()
        return group.close


class PassHistory:
    """What a Dataset keeps between its passes: the next epoch and what the latest pass tuned.

    A pass takes its epoch from it when it starts, moves it when a checkpoint is loaded (the
    pass after a resumed one is the epoch after the checkpoint's), and leaves its tuned values
    in it when it ends, so that ``explain()`` describes the last pass until a new one starts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_epoch = 0
        self._passes = 0
        self._tuned: dict[str, int] = {}

    def start(self) -> tuple[int, int]:
        """``(pass number, epoch)`` of a new pass; it becomes the latest."""
        with self._lock:
            epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
            self._passes += 1
            self._tuned = {}
            return self._passes, epoch

    def resumed(self, epoch: int) -> None:
        """A pass now continues ``epoch`` (from a checkpoint): the next pass is the one after it."""
        with self._lock:
            self._next_epoch = epoch + 1

    def ended(self, number: int, tuned: dict[str, int]) -> None:
        """Pass ``number`` ended (or was closed) with these AUTOTUNE values."""
        with self._lock:
            if number == self._passes:
                self._tuned = dict(tuned)

    def last_tuned(self) -> dict[str, int]:
        """The values the latest pass left when it ended; empty while it runs or if it tuned nothing."""
        with self._lock:
            return dict(self._tuned)


class PipelineIterator:
    """The iterator ``iter(dataset)`` returns: one pass, checkpointable, closable.

    It owns the seed of the pass (``Options.seed``, or a fresh random one) and the epoch, so
    a state dict restores both: loading it rebuilds the iterator tree with the saved seed and
    epoch and then restores every op's position. When the pipeline has AUTOTUNE knobs (and
    ``Options.autotune.enabled``), it starts the autotuner with the first element.
    """

    def __init__(self, plan: Plan, history: PassHistory) -> None:
        interrupts.watch()
        self._plan = plan
        self._seeded = plan.options.seed is not None
        self._seed = plan.pass_seed()
        closer = plan.open_pass()
        self._pass_finalizer = weakref.finalize(self, closer) if closer is not None else None
        self._history = history
        self._number, self._epoch = history.start()
        self._tree: Iterator | None = None
        self._finalizer: weakref.finalize | None = None
        self._clock = ConsumerClock()
        self._tuner: Autotuner | None = None
        self._start: Look = start_look()
        self._log: TraceLog | None = None
        self._waits: Track | None = None  # the training loop's track in a traced pass
        self._warning = plan.warning  # said at the first element
        self._first = True

    def _build(self) -> Iterator:
        trace = self._plan.options.trace
        log = TraceLog(every_element=trace == "all") if trace else None
        ctx = BuildContext(
            self._seed,
            self._seeded,
            self._epoch,
            self._plan.options,
            memory=self._plan.memory,
            salt=self._plan.salt,
            trace=log,
        )
        tree = ctx.traced(self._plan.runtime_root.build(ctx))
        tuning, clock, tuner = self._plan.options.autotune, ConsumerClock(), None
        if tuning.enabled and live_knobs(tree):
            tuner = Autotuner(
                tree,
                clock,
                functools.partial(Budget.of_machine, tuning.cpu_budget, tuning.ram_budget),
            )
            if log is not None:
                tuner.trace = functools.partial(
                    _record_round, log, log.track((TUNER,), "autotune", TUNER, ())
                )
        self._log, self._waits = log, log.consumer if log is not None else None
        self._finalizer = weakref.finalize(self, _close, tree, tuner, self._history, self._number)
        tree.prepare()
        self._tree, self._tuner, self._clock, self._start = tree, tuner, clock, start_look()
        return tree

    def __iter__(self) -> PipelineIterator:
        return self

    def _at_first(self, element: Any) -> None:
        """The pass's first element: the plan's warning is said, and this process's heap keeps
        room for elements of its size between them (``runtime/heap.py``)."""
        self._first = False
        if self._warning is not None:
            _warn_once(self._warning)
        hold_free(heap_bytes(element))

    @property
    def tree(self) -> Iterator | None:
        """The pass's iterator tree, its root op's iterator (None until the first element or
        state builds it): a seam for tests and tools that look at a running pass's stages."""
        return self._tree

    def __next__(self) -> Any:
        interrupts.raise_dropped()  # a Ctrl-C that a finalizer of the last element swallowed
        tree = self._tree if self._tree is not None else self._build()
        clock, tuner, waits = self._clock, self._tuner, self._waits
        clock.enter()  # the time between two calls is the training step's (stats and the tuner)
        if waits is not None:
            t0 = time.perf_counter()
        try:
            element = next(tree)
        except StopIteration:
            if tuner is not None:
                tuner.stop()
            raise
        if tuner is not None and not tuner.started:
            tuner.tick()  # the first element starts the tuner's first window; its thread, the first round
        if self._first:
            self._at_first(element)
        delivered(element)
        clock.leave()
        if waits is not None:
            waits.span(t0, time.perf_counter())
        return element

    def state_dict(self) -> dict[str, Any]:
        """The position of this pass: load it into a fresh ``iter(ds)`` to get the rest."""
        tree = self._tree if self._tree is not None else self._build()
        return {
            "format": _FORMAT,
            "ops": self._plan.fingerprint(),
            "seed": self._seed,
            "epoch": self._epoch,
            "pipeline": tree.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next element is the one after the checkpoint.

        Raises:
            CheckpointError: if ``state`` came from a pipeline of other ops, other parameters or
                another format, or a value in it is malformed; the message says what differs.
        """
        if not isinstance(state, dict) or state.get("format") not in (_FORMAT, 2):
            raise CheckpointError("not a torchpipe iterator state (missing or unknown 'format')")
        if state["format"] == 2:
            raise CheckpointError(
                "checkpoint has format 2, from an older torchpipe: it names the ops but not their "
                "parameters, so it cannot be checked against this pipeline and is not loaded; "
                "start the epoch afresh (checkpoints saved from now on have format 3)"
            )
        difference = _difference(state.get("ops"), self._plan.fingerprint())
        if difference is not None:
            raise CheckpointError(difference)
        missing = [key for key in ("seed", "epoch", "pipeline") if key not in state]
        if missing:
            raise CheckpointError(f"pipeline: state is missing {missing}")
        seed, epoch = (
            check_int("pipeline", state, "seed", minimum=0),
            check_int("pipeline", state, "epoch", minimum=0),
        )
        self._close_tree()
        self._seed, self._epoch = seed, epoch
        self._history.resumed(epoch)
        self._build().load_state_dict(state["pipeline"])

    def close(self) -> None:
        """Stop background threads and release buffers. Safe to call more than once."""
        if self._pass_finalizer is not None:
            self._pass_finalizer()  # first: a thread waiting on the other ranks then wakes with an error
        self._close_tree()

    def _close_tree(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._tree = None

    def stats(self) -> PipelineStats:
        """Per-stage stats, root first; ``print()`` the result for a report that names the
        bottleneck and says whether the training loop or the pipeline is the limit.

        See :class:`~torchpipe.autotune.report.PipelineStats`.
        """
        if self._tree is None:
            return PipelineStats([], 0.0, "", 0.0, [])
        trace = self._log.snapshot() if self._log is not None else None
        return pipeline_stats(
            self._tree, self._start, self._clock.outside_s(), self.decisions(), trace
        )

    def trace(self, path: str | os.PathLike) -> None:
        """Write the pass so far as a Chrome trace / Perfetto JSON file (open it in ui.perfetto.dev
        or chrome://tracing): a track per stage and per thread or worker process that ran its
        calls, the training loop's waits for data, counters for buffer occupancy and knob values.

        Raises:
            RuntimeError: if the pass is not traced: build it with
                ``ds.with_options(tp.Options(trace=True))``.
        """
        from torchpipe.observe.chrome_trace import write_chrome_trace

        if self._log is None:
            raise RuntimeError(_NOT_TRACED)
        write_chrome_trace(self._log.snapshot(), path)

    def decisions(self) -> list[Decision]:
        """The autotuner's recent rounds, oldest first (empty without AUTOTUNE knobs)."""
        return list(self._tuner.decisions) if self._tuner is not None else []

    def tuned_values(self) -> dict[str, int]:
        """The current value of every AUTOTUNE knob of this pass (empty before it starts)."""
        return _tuned_values(self._tuner)

    def __enter__(self) -> PipelineIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_NOT_TRACED = (
    "this pass is not traced: run it with ds.with_options(tp.Options(trace=True)) (or trace='all' for "
    "every element) to record it for trace() and stats().plot()"
)


def _record_round(log: TraceLog, track: Track, decision: Decision) -> None:
    log.instant(
        track,
        "autotune round",
        {
            "throughput": decision.throughput,
            "predicted": decision.predicted,
            "bottleneck": decision.bottleneck,
            "changed": list(decision.changed),
        },
    )


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Warn ``message`` the first time this process meets it."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _cannot_talk() -> str:
    if worker_info() is not None:
        return "a torch DataLoader worker cannot talk to the other ranks"
    return "torch.distributed is not initialized for the ranks"


def _close(tree: Iterator, tuner: Autotuner | None, history: PassHistory, number: int) -> None:
    if tuner is not None:
        tuner.stop()
    history.ended(number, _tuned_values(tuner))
    tree.close()


def _tuned_values(tuner: Autotuner | None) -> dict[str, int]:
    return (
        {name: knob.value for name, knob in sorted(tuner.knobs_by_name.items())}
        if tuner is not None
        else {}
    )


def _difference(saved: Any, mine: list[str]) -> str | None:
    """What differs between a checkpoint's ``ops`` and this plan's fingerprint, or None."""
    if (
        not isinstance(saved, list)
        or "->" not in saved
        or not all(isinstance(line, str) for line in saved)
    ):
        return f"checkpoint's 'ops' is malformed: {saved!r}"
    if saved == mine:
        return None
    split_saved, split_mine = saved.index("->"), mine.index("->")
    written, mine_written = saved[:split_saved], mine[:split_mine]
    kinds, mine_kinds = (
        [line.split("(", 1)[0] for line in written],
        [line.split("(", 1)[0] for line in mine_written],
    )
    if kinds != mine_kinds:
        return f"checkpoint is from another pipeline: ops {kinds} vs {mine_kinds}"
    if written != mine_written:
        changed = "; ".join(
            f"op {i} was {old}, here it is {new}"
            for i, (old, new) in enumerate(zip(written, mine_written))
            if old != new
        )
        return f"checkpoint is from this pipeline with other parameters: {changed}"
    return (
        "checkpoint is from this pipeline optimized differently (Options.optimizations changed?): "
        f"it ran as {saved[split_saved + 1 :]}, this runs as {mine[split_mine + 1 :]}"
    )

"""An auto epoch's first batches: where they are placed, measured here, and a head start.

With ``num_workers="auto"`` the first epoch's first batches are made in the main process and
timed (:func:`~torchpipe.runtime.placement.measure.measure_calls`): the policy decides from them
where the rest go; a later epoch goes where the last one left them. :class:`FirstBatches` is
that part of the DataLoader's worker iterator (:class:`~torchpipe.loader.workers.WorkerIterator`),
a mixin sharing its state.

Where the first batch takes long (JPEG decodes: 50-60 ms), the other cores waited for the
decision, then for the workers to start: a short epoch (``cache``'s 16 batches) lost about a
batch of one core to it against torch's workers, started at ``iter()``. :class:`HeadStart`
starts one worker process on the batch after the first if the first still runs after
:data:`HEAD_START_S`; what it makes is delivered in its place, wherever the decision then puts
the rest (on processes, that worker goes on). A first batch made sooner (cheap rows) starts
nothing: the next batches are measured here, as before, and the zygote forked for the head start
goes with the decision.

The zygote is forked by the main thread before the first batch
(:meth:`~torchpipe.runtime.processes.pool.ProcessPool.fork_zygote`), not by the timer's thread
while the user's code runs on the main one: a lock that code held would stay held in every
worker. The timer's thread uses the pool only until :meth:`HeadStart.settle` returns, the main
thread only after: never both at once.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from torchpipe.core.tunable import WeakStage
from torchpipe.loader.fetch import LocalFetch
from torchpipe.loader.memory import LoaderMemory
from torchpipe.randomness import (
    GlobalDraws,
    global_rng_states,
    restore_global_rng_states,
    seeds_were_set,
)
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.runtime.dispatch import Dispatcher
from torchpipe.runtime.placement.auto_stage import AutoStage
from torchpipe.runtime.placement.costs import INLINE, PROCESS
from torchpipe.runtime.placement.measure import measure_calls
from torchpipe.runtime.placement.placement import Placement
from torchpipe.runtime.placement.policy import Policy
from torchpipe.runtime.processes.pool import ProcessPool

HEAD_START_S = 0.01
"""How long the first batch runs here before a worker starts on the next one: a cheap batch
(``records``: 0.15 ms) never waits this long, a JPEG batch (50-60 ms) leaves the worker most of
its time."""

Call = tuple[int, Any]
"""A numbered batch: ``(seq, payload)``."""


class HeadStart:
    """One worker process started on ``calls`` where the first batch runs past :data:`HEAD_START_S`.

    Made (the zygote forked, on the caller's thread) before the first batch is made;
    :meth:`arm` as that batch starts; :meth:`settle` once it has run, before
    anything else is done with the pool or ``calls``.

    Args:
        pool: the loader's worker processes (none running yet).
        calls: the batches after the first, numbered, for the worker.
    """

    def __init__(self, pool: ProcessPool, calls: list[Call]) -> None:
        pool.fork_zygote()
        self._pool, self._calls = pool, calls
        self._lock = threading.Lock()
        self._waiting = self._started = False
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._timer: threading.Timer | None = None

    @property
    def armed(self) -> bool:
        """Whether the first batch has started (the timer runs or ran)."""
        return self._timer is not None

    def arm(self) -> None:
        """The first batch starts now: the worker starts on ``calls`` if it still runs then."""
        self._waiting = True
        self._timer = threading.Timer(HEAD_START_S, self._start)
        self._timer.name, self._timer.daemon = "torchpipe-head-start", True
        self._timer.start()

    def _start(self) -> None:
        with self._lock:
            if not self._waiting:
                return  # settled first
            self._started = True
        try:
            self._pool.resize(1)
            for seq, payload in self._calls:
                self._pool.submit(seq, payload)
        except BaseException as e:  # noqa: BLE001 - raised on the main thread by settle()
            self._error = e
        finally:
            self._done.set()

    def settle(self) -> list[Call]:
        """The first batch has run: the calls the worker took (none where it did not start in
        time: they are to be made as if there had been no head start).

        Raises:
            BaseException: what starting the worker raised (an open-files limit, say).
        """
        with self._lock:
            self._waiting = False
            started = self._started
        if self._timer is not None:
            self._timer.cancel()
        if not started:
            return []
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._calls


class FirstBatches:
    """Where an auto epoch's batches go, and the first epoch's first batches, made here and
    measured with a head start."""

    _tp_state: Any
    _placement: Placement | None
    _executors: AutoStage | None
    _local: dict[str, LocalFetch]
    _stage: WeakStage
    _pool: ProcessPool
    _dispatch: Dispatcher
    _memory: LoaderMemory
    _generator: Any
    _seq: int
    _task_slot: dict[int, int | None]
    _sampler_done: bool
    _primed: tuple[int, int, Any] | None
    _ahead: deque[Call]  # batches drawn and numbered ahead for the head start, not yet sent
    _head: HeadStart | None

    if TYPE_CHECKING:  # the iterator's own, and its budget's

        def _next_payload(self) -> tuple[int, int, Any] | None: ...
        def _hold_peak(self, workers: int) -> None: ...

    def _place(self) -> None:
        """Where this epoch's batches go: where the last epoch left them, or, the first time, where
        the policy puts them after a few batches made here and measured. A dataset that draws from
        the global RNGs stays off threads (which share them) only where seeds were set: without,
        its draws differ on every run anyway (:func:`seeds_were_set`)."""
        policy, state, placement = self._tp_state.policy, self._tp_state, self._placement
        assert policy is not None and placement is not None  # num_workers="auto" (_start_auto)
        if policy.kind is not None:
            if placement.kind == policy.kind and placement.workers == (state.tuned_workers or 0):
                placement.new_pass()  # persistent workers: the batches stay where they were made
            else:
                placement.move(policy.kind, state.tuned_workers or 0, again=True)
            return

        def drawn(draws: GlobalDraws) -> None:  # from here on only these are seeded and put back
            state.drawn_rngs = self._local[INLINE].rngs = tuple(sorted(draws.drawn))

        # The sampler draws its epoch's seed from the global RNGs when its first batch is drawn (as
        # torch's does): that draw must stay, the measured batches' own draws must not.
        self._primed = self._next_payload()
        head = self._head = self._head_start(policy)
        # once: putting them back after every measured batch would be measured
        saved = global_rng_states()
        try:
            costs, _ = measure_calls(self._run_inline, on_draws=drawn)
        finally:
            restore_global_rng_states(saved)
            self._settle_head()
        must_repeat = bool(state.drawn_rngs) and seeds_were_set(self._generator)
        self._hold_peak(0)  # the budget caps the workers before the first move, not after it
        placement.decide(costs.without_threads() if must_repeat else costs)
        if head is not None and placement.kind != PROCESS and not self._pool.size:
            self._pool.release_zygote()  # forked for a head start that did not start

    def _head_start(self, policy: Policy) -> HeadStart | None:
        """A head start (:class:`HeadStart`, docs/autotune.md) for the batch after the primed
        one, both numbered now (the primed one is measured first). None under a RAM budget the
        user gave, on one core, where processes are no candidate, or for a one-batch epoch."""
        if (
            PROCESS not in policy.candidates
            or self._primed is None
            or usable_cpu_count() < 2
            or self._memory.given
        ):
            return None
        first, self._primed = self._primed, None
        for payload in (first, self._next_payload()):
            if payload is None:
                return None  # a one-batch epoch
            self._ahead.append((self._seq, payload))
            self._task_slot[self._seq] = None  # map-style: made by no replica
            self._seq += 1
        return HeadStart(self._pool, [self._ahead[-1]])

    def _settle_head(self) -> None:
        """The first measured batch has run: the batches a head start's worker took are delivered
        in their places (and its pool retired once they are made, unless the calls go there)."""
        head, self._head = self._head, None
        if head is None:
            return
        sent = head.settle()
        if not sent:
            return
        seqs = [seq for seq, _ in sent]
        self._ahead = deque(call for call in self._ahead if call[0] not in seqs)
        self._dispatch.adopt(self._pool, seqs, AutoStage.let_go)

    def _run_inline(self, limit: int) -> list[Any]:
        """The first batches, made here and timed: the policy's first measurement."""
        assert self._executors is not None  # num_workers="auto" (_start_auto)
        inline = self._local[INLINE]
        results = self._executors.run_inline(
            limit, self._next_call, lambda seq, payload: inline.seeded(payload)
        )
        made = next((value for value in results if value is not None), None)
        if made is not None and not self._stage.stats.bytes_n:
            self._stage.stats.sample_bytes(made)  # the peak is predicted before the first move
        return results

    def _next_call(self) -> Call | None:
        """The next batch as a numbered call, made here (one drawn ahead first); None at the end.
        The first measured call arms the head start, the next settles it."""
        if self._head is not None:
            if self._head.armed:
                self._settle_head()
            else:
                self._head.arm()
        call = self._numbered()
        if call is not None:
            self._task_slot[call[0]] = None
        return call

    def _numbered(self) -> Call | None:
        """The next batch as a numbered call: one drawn ahead, else the sampler's next; None at the end."""
        if self._ahead:
            return self._ahead.popleft()
        payload = None if self._sampler_done else self._next_payload()
        if payload is None:
            return None
        self._seq += 1
        return self._seq - 1, payload

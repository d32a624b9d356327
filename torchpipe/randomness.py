"""Seeds: deriving per-op and per-element seeds, seeding the global RNGs, and ``tp.rng()``.

Every seed is a pure function of the pipeline seed and a position (the op's place in the graph,
the epoch, enclosing repetitions, the element's sequence number at its stage). That is what
makes output independent of worker counts, executors and resumes.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from torchpipe.seed_sequences import PresetSeedSequence, pcg64_states

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (order matters; cheap: ~0.3 us a part)."""
    h = _GOLDEN
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK64))
    return h >> 1


def fresh_seed() -> int:
    """A random 63-bit seed from the OS, for pipelines that were given none."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def seeds_were_set(generator: torch.Generator | None) -> bool:
    """Whether a DataLoader's random draws are meant to repeat from run to run: it was given a
    ``generator``, or torch's default generator (which its epochs' base seeds are drawn from
    without one) was seeded by the user.

    torch seeds its default generator at start-up with a random 64-bit number, so its batches'
    draws differ on every run unless someone seeded it; the seeds people set
    (``torch.manual_seed(42)``, Lightning's ``seed_everything``, Hugging Face's ``set_seed``) are
    below 2**32, and a start-up seed is, once in 2**32 runs.

    Args:
        generator: the loader's ``generator`` argument.
    """
    return generator is not None or torch.initial_seed() < 2**32


GLOBAL_RNGS = ("random", "numpy", "torch")
"""The global RNGs user code draws from: ``random``, numpy's legacy global RandomState, torch's
default CPU generator."""

_SEEDERS: dict[str, Callable[[int], Any]] = {
    "random": random.seed,
    "numpy": lambda seed: np.random.seed(seed & 0xFFFFFFFF),
    "torch": torch.default_generator.manual_seed,
}
_GETTERS: dict[str, Callable[[], Any]] = {
    "random": random.getstate,
    "numpy": np.random.get_state,
    "torch": torch.get_rng_state,
}
_SETTERS: dict[str, Callable[[Any], Any]] = {
    "random": random.setstate,
    "numpy": np.random.set_state,
    "torch": torch.set_rng_state,
}


def seed_global_rngs(seed: int, rngs: tuple[str, ...] = GLOBAL_RNGS) -> None:
    """Seed the global RNGs named in ``rngs`` (all three: ~15 us)."""
    for name in rngs:
        _SEEDERS[name](seed)


def global_rng_states(rngs: tuple[str, ...] = GLOBAL_RNGS) -> dict[str, Any]:
    """The states of the global RNGs named in ``rngs`` (numpy's costs ~90 us, the others a few)."""
    return {name: _GETTERS[name]() for name in rngs}


def restore_global_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`global_rng_states` returned."""
    for name, state in states.items():
        _SETTERS[name](state)


class GlobalDraws:
    """Which global RNGs calls seeded by :func:`call_seeded` drew from (see
    :func:`watch_global_draws`), and the seconds spent finding out.

    Attributes:
        drawn: the names (from :data:`GLOBAL_RNGS`) of the RNGs some call drew from.
        overhead_s: seconds spent reading RNG states around the calls (not the calls' cost).
    """

    def __init__(self) -> None:
        self.drawn: set[str] = set()
        self.overhead_s = 0.0

    @property
    def drew(self) -> bool:
        return bool(self.drawn)


class _CallState(threading.local):
    # The element seed is mixed only when tp.rng() asks for it: most calls never do.
    stage_seed: int | None = None
    seq: int = 0
    generator: np.random.Generator | None = None
    generator_seq: int = -1  # the seq ``generator`` is the element generator of
    watch: GlobalDraws | None = None
    # the last (stage_seed, seq) tp.rng() seeded, and the PCG64 states of a window of seqs
    # after it (rng_window): a stage's elements come to a thread in increasing order
    last: tuple[int, int] | None = None
    window: tuple[int, int, np.ndarray, np.ndarray] | None = None


@contextlib.contextmanager
def watch_global_draws() -> Iterator[GlobalDraws]:
    """Within the block, this thread's :func:`call_seeded` calls note whether the function drew
    from the global RNGs after they were seeded (a few us a call; for measuring, not for every
    element)."""
    watch, state = GlobalDraws(), _call_state
    previous, state.watch = state.watch, watch
    try:
        yield watch
    finally:
        state.watch = previous


def call_seeded(
    seed: int, fn: Callable[..., Any], *args: Any, rngs: tuple[str, ...] = GLOBAL_RNGS
) -> Any:
    """Seed the global RNGs named in ``rngs`` with ``seed``, then return ``fn(*args)``."""
    seed_global_rngs(seed, rngs)
    watch = _call_state.watch
    if watch is None:
        return fn(*args)
    t0 = time.perf_counter()
    before = global_rng_states()
    watch.overhead_s += time.perf_counter() - t0
    try:
        return fn(*args)
    finally:
        t0 = time.perf_counter()
        after = global_rng_states()
        watch.drawn.update(
            name for name in GLOBAL_RNGS if not _same_state(before[name], after[name])
        )
        watch.overhead_s += time.perf_counter() - t0


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if (
        isinstance(a, tuple) and len(a) == 5 and isinstance(a[1], np.ndarray)
    ):  # numpy's legacy state
        return a[2] == b[2] and np.array_equal(a[1], b[1])
    return a == b


_call_state = _CallState()

_Saved = tuple[Any, int, Any, int]


def enter_call(stage_seed: int, seq: int) -> _Saved:
    """Make element ``seq`` of a stage current for this thread's ``tp.rng()``; returns what to
    restore (calls nest when a user function iterates a pipeline itself)."""
    state = _call_state
    prev = (state.stage_seed, state.seq, state.generator, state.generator_seq)
    state.stage_seed, state.seq, state.generator = stage_seed, seq, None
    return prev


def call_state() -> _CallState:
    """This thread's call state: a stage that runs a batch's elements enters the first
    (:func:`enter_call`), then sets ``seq`` to each next one (an attribute write, no call: a cheap
    function's element costs little more), and ``tp.rng()`` follows it."""
    return _call_state


def exit_call(prev: _Saved) -> None:
    """Undo :func:`enter_call`."""
    state = _call_state
    state.stage_seed, state.seq, state.generator, state.generator_seq = prev


def rng() -> np.random.Generator:
    """The numpy Generator of the element being processed by the current user function.

    It is seeded from (pipeline seed, epoch, stage, element sequence number), so a function
    that draws from it produces the same output for any worker count or executor and after a
    resume. Repeated calls within one function call return the same generator.

    Raises:
        RuntimeError: when called outside a function that a torchpipe pipeline is running.
    """
    state = _call_state
    if state.stage_seed is None:
        raise RuntimeError(
            "tp.rng() can only be called inside a function run by a torchpipe pipeline"
        )
    gen = state.generator
    if gen is None or state.generator_seq != state.seq:  # the element changed since
        gen = state.generator = np.random.Generator(np.random.PCG64(_seed_of(state)))
        state.generator_seq = state.seq
    return gen


RNG_WINDOW = 64
"""Elements whose PCG64 states :func:`rng` hashes at once (numpy's ``SeedSequence`` costs ~8 us
a seed alone, ~1 us in a window), once it sees a stage's elements come in order."""


def _seed_of(state: _CallState) -> int | PresetSeedSequence:
    """What the current element's PCG64 is seeded with: ``mix_seed(stage_seed, seq)``, or its
    state hashed beforehand with the next elements' where the last element seeded on this thread
    was one of the same stage shortly before (the same generator either way)."""
    stage_seed, seq = state.stage_seed, state.seq
    assert stage_seed is not None
    last, state.last = state.last, (stage_seed, seq)
    window = state.window
    if window is None or window[0] != stage_seed or not 0 <= seq - window[1] < RNG_WINDOW:
        if last is None or last[0] != stage_seed or not 0 < seq - last[1] <= 4 * RNG_WINDOW:
            return mix_seed(stage_seed, seq)
        seeds = _mix_seeds(stage_seed, seq, RNG_WINDOW)
        window = state.window = (stage_seed, seq, seeds, pcg64_states(seeds))
    i = seq - window[1]
    return PresetSeedSequence(int(window[2][i]), window[3][i])


def _mix_seeds(stage_seed: int, first: int, count: int) -> np.ndarray:
    """``mix_seed(stage_seed, seq)`` for ``count`` seqs from ``first``, as a uint64 array."""
    h = np.uint64(_splitmix64(_GOLDEN ^ (stage_seed & _MASK64)))
    x = (np.arange(first, first + count, dtype=np.uint64) ^ h) + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) >> np.uint64(1)


def sampling_rng_state(generator: torch.Generator | None) -> torch.Tensor:
    """The state of what a DataLoader samples with: its ``generator``, else torch's global one."""
    return generator.get_state() if generator is not None else torch.get_rng_state()


def set_sampling_rng_state(generator: torch.Generator | None, state: torch.Tensor) -> None:
    """Put back a :func:`sampling_rng_state`."""
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)

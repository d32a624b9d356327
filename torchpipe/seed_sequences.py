"""numpy's ``SeedSequence`` hash for many seeds at once, so ``tp.rng()`` seeds a PCG64 cheaply.

``np.random.PCG64(seed)`` spends most of its ~8 us hashing ``seed`` through a ``SeedSequence``
(a pool of four 32-bit words mixed with each other, then ``generate_state(4, np.uint64)``). The
hash runs the same sequence of 32-bit multiplications, xors and shifts for every seed, with
constants that do not depend on it, so :func:`pcg64_states` runs it on arrays: 64 seeds cost about
as much as ten one at a time. :class:`PresetSeedSequence` hands such a state to ``PCG64``, which
then holds exactly the state, and draws exactly the numbers, of ``PCG64(seed)``
(``tests/test_seed_sequences.py`` checks it against numpy for seeds of every width).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.random.bit_generator import ISpawnableSeedSequence

_MASK32 = 0xFFFFFFFF
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875  # the pool's mixing
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED  # generate_state's
_MIX_L, _MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
_POOL = 4  # SeedSequence's default pool size: 4 words
_WORDS = 8  # generate_state(4, np.uint64): 8 32-bit words


def _constants(init: int, mult: int, count: int) -> list[np.uint32]:
    """The hash constant before each of ``count`` steps, and after the last (it advances by a
    multiplication, whatever is hashed)."""
    out, h = [], init
    for _ in range(count + 1):
        out.append(np.uint32(h))
        h = (h * mult) & _MASK32
    return out


_A = _constants(_INIT_A, _MULT_A, _POOL + _POOL * (_POOL - 1))
_B = _constants(_INIT_B, _MULT_B, _WORDS)


def _hash(value: np.ndarray, before: np.uint32, after: np.uint32) -> np.ndarray:
    """One step of the hash: ``((value ^ before) * after) ^ (that >> 16)``, in 32 bits."""
    value = (value ^ before) * after
    return value ^ (value >> 16)


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result = _MIX_L * x - _MIX_R * y
    return result ^ (result >> 16)


def pcg64_states(seeds: np.ndarray) -> np.ndarray:
    """``np.random.SeedSequence(s).generate_state(4, np.uint64)`` for each seed ``s`` below 2**64.

    Args:
        seeds: a 1-D array of non-negative seeds (uint64).

    Returns:
        A ``(len(seeds), 4)`` uint64 array, a row a seed.
    """
    seeds = np.asarray(seeds, dtype=np.uint64)
    # The seed's 32-bit words, low first; one below 2**32 has one word, which pools as [low, 0].
    entropy = [(seeds & _MASK32).astype(np.uint32), (seeds >> 32).astype(np.uint32)]
    zero = np.zeros_like(entropy[0])
    pool = [_hash(entropy[i] if i < 2 else zero, _A[i], _A[i + 1]) for i in range(_POOL)]
    step = _POOL
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hash(pool[src], _A[step], _A[step + 1]))
                step += 1
    words = np.empty((len(seeds), _WORDS), dtype="<u4")
    for i in range(_WORDS):
        words[:, i] = _hash(pool[i % _POOL], _B[i], _B[i + 1])
    return words.view("<u8").astype(np.uint64)


class PresetSeedSequence(ISpawnableSeedSequence):
    """The ``SeedSequence`` of ``seed``, its PCG64 state computed beforehand
    (:func:`pcg64_states`): ``np.random.PCG64(PresetSeedSequence(seed, state))`` is
    ``np.random.PCG64(seed)``. Everything else (``spawn``, ``entropy``, other states) is the real
    ``np.random.SeedSequence(seed)``'s, made when first asked for."""

    def __init__(self, seed: int, state: np.ndarray) -> None:
        self.seed = seed
        self._state = state
        self._real: np.random.SeedSequence | None = None

    @property
    def real(self) -> np.random.SeedSequence:
        if self._real is None:
            self._real = np.random.SeedSequence(self.seed)
        return self._real

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> np.ndarray:
        if n_words == _POOL and np.dtype(dtype) == np.uint64:
            return self._state
        return self.real.generate_state(n_words, dtype)

    def spawn(self, n_children: int) -> list[np.random.SeedSequence]:
        return self.real.spawn(n_children)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.real, name)

import numpy as np
import pytest

import torchpipe as tp
from torchpipe.randomness import RNG_WINDOW, _mix_seeds, mix_seed
from torchpipe.seed_sequences import PresetSeedSequence, pcg64_states

EDGES = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 2**64 - 1]


def test_the_states_are_numpys_for_seeds_of_every_width():
    seeds = EDGES + [int(s) for s in np.random.default_rng(0).integers(0, 2**63, 200)]
    states = pcg64_states(np.array(seeds, dtype=np.uint64))
    for seed, state in zip(seeds, states):
        assert state.tolist() == np.random.SeedSequence(seed).generate_state(4, np.uint64).tolist()


@pytest.mark.parametrize("seed", [0, 2**32 + 7, 2**63 - 1])
def test_a_preset_pcg64_is_pcg64_of_the_seed(seed):
    state = pcg64_states(np.array([seed], dtype=np.uint64))[0]
    mine = np.random.PCG64(PresetSeedSequence(seed, state))
    numpys = np.random.PCG64(seed)
    assert mine.state == numpys.state
    assert np.array_equal(
        np.random.Generator(mine).random(8), np.random.Generator(numpys).random(8)
    )
    assert mine.seed_seq.entropy == seed  # the rest is the real SeedSequence's
    assert mine.seed_seq.generate_state(3).tolist() == numpys.seed_seq.generate_state(3).tolist()
    children, theirs = np.random.Generator(mine).spawn(2), np.random.Generator(numpys).spawn(2)
    assert [c.random() for c in children] == [c.random() for c in theirs]


def test_mixed_seeds_are_mix_seeds():
    stage = mix_seed(5, 9)
    assert _mix_seeds(stage, 10, 70).tolist() == [mix_seed(stage, s) for s in range(10, 80)]


def _draws(i):
    gen = tp.rng()
    return float(gen.random()), int(gen.integers(2**62))


@pytest.mark.parametrize("parallel", [None, 3])
def test_elements_draw_the_same_whether_hashed_alone_or_in_a_window(parallel, monkeypatch):
    from torchpipe import randomness

    def run():
        ds = tp.range(3 * RNG_WINDOW + 5).map(
            _draws, num_parallel_calls=parallel, executor="thread"
        )
        return list(ds.with_options(tp.Options(seed=11)))

    windows = []
    hashed = randomness.pcg64_states

    def spy(seeds):
        windows.append(len(seeds))
        return hashed(seeds)

    monkeypatch.setattr(randomness, "pcg64_states", spy)
    in_windows = run()
    assert windows  # elements in order were hashed a window at a time
    monkeypatch.setattr(randomness, "RNG_WINDOW", 0)  # each element hashed alone, as numpy does
    alone = run()
    assert in_windows == alone and len(set(alone)) == len(alone)

"""The ops that split a pipeline between ranks (``torchpipe/distributed/nodes.py``), on their own:
who owns which element, the equal shares ``"drop"`` and ``"pad"`` make, a share's state, and the
equalizer's agreement with the other ranks (a fake one here; tests/distributed/test_gloo_ranks.py
runs real process groups)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

import torchpipe as tp
from torchpipe.core.node import BuildContext
from torchpipe.distributed.nodes import EqualizeNode, Share, ShareLimits, ShareNode
from torchpipe.errors import CheckpointError

SHAPES = [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (1, 3)]
"""(world_size, num_workers) pairs."""


def _ctx() -> BuildContext:
    return BuildContext(seed=0, seeded=False, epoch=0, options=tp.Options())


def _shares(world_size: int, num_workers: int) -> list[Share]:
    return [
        Share(world_size, r, num_workers, w) for r in range(world_size) for w in range(num_workers)
    ]


def _share_of(total: int, share: Share, uneven: str) -> list[int]:
    node = ShareNode(tp.range(total)._node, share, "data", uneven)
    return list(node.build(_ctx()))


@pytest.mark.parametrize("world_size, num_workers", SHAPES)
def test_every_element_has_one_owner_and_count_says_how_many_are_a_shares(world_size, num_workers):
    shares = _shares(world_size, num_workers)
    for index in range(60):
        assert sum(share.owns(index) for share in shares) == 1, index
    for share, stop in itertools.product(shares, range(40)):
        assert share.count(stop) == sum(share.owns(i) for i in range(stop)), (share, stop)


def test_a_ranks_share_is_the_same_with_or_without_torch_workers():
    alone = [i for i in range(50) if Share(3, 1).owns(i)]
    split = sorted(i for w in range(2) for i in range(50) if Share(3, 1, 2, w).owns(i))
    assert split == alone


@pytest.mark.parametrize("world_size, num_workers", SHAPES)
@pytest.mark.parametrize("total", [0, 1, 5, 7, 12])
def test_allow_splits_every_element_once(world_size, num_workers, total):
    got = [_share_of(total, share, "allow") for share in _shares(world_size, num_workers)]
    assert sorted(itertools.chain(*got)) == list(range(total))


@pytest.mark.parametrize("world_size, num_workers", SHAPES)
@pytest.mark.parametrize("total", [0, 1, 5, 7, 12])
def test_drop_gives_every_rank_as_many_and_leaves_out_only_the_last_remainder(
    world_size, num_workers, total
):
    by_rank: dict[int, list[int]] = {}
    for share in _shares(world_size, num_workers):
        elements = _share_of(total, share, "drop")
        node = ShareNode(tp.range(total)._node, share, "data", "drop")
        assert node.cardinality() == len(elements)
        by_rank.setdefault(share.rank, []).extend(elements)
    kept = world_size * (total // world_size)
    assert {len(elements) for elements in by_rank.values()} == {total // world_size}
    assert sorted(itertools.chain(*by_rank.values())) == list(range(kept))


@pytest.mark.parametrize("world_size, num_workers", SHAPES)
@pytest.mark.parametrize("total", [1, 5, 7, 12])
def test_pad_gives_every_rank_as_many_by_repeating_elements_other_ranks_had(
    world_size, num_workers, total
):
    by_rank: dict[int, list[int]] = {}
    for share in _shares(world_size, num_workers):
        elements = _share_of(total, share, "pad")
        node = ShareNode(tp.range(total)._node, share, "data", "pad")
        assert node.cardinality() == len(elements)
        by_rank.setdefault(share.rank, []).extend(elements)
    assert {len(elements) for elements in by_rank.values()} == {-(-total // world_size)}
    everything = list(itertools.chain(*by_rank.values()))
    assert set(everything) == set(range(total))  # nothing lost
    repeats = len(everything) - total
    assert repeats == (-total) % world_size  # the ranks one short got one element again


def test_share_limits_for_unknown_length_read_to_the_end():
    assert ShareLimits.of(None, Share(2, 0), "drop") == ShareLimits(None, None)
    assert ShareLimits.of(7, Share(2, 0), "allow") == ShareLimits(None, None)
    assert ShareLimits.of(7, Share(2, 0), "drop") == ShareLimits(6, None)


def test_a_file_level_split_never_drops_or_pads():
    node = ShareNode(tp.range(5)._node, Share(2, 1), "file", "drop")
    assert list(node.build(_ctx())) == [1, 3] and node.cardinality() == 2


def test_a_share_resumes_exactly_from_its_state_mid_pass():
    share = Share(3, 2, 2, 1)
    node = ShareNode(tp.range(40)._node, share, "data", "pad")
    whole = list(node.build(_ctx()))
    first = node.build(_ctx())
    head = [next(first) for _ in range(2)]
    state = first.state_dict()
    resumed = node.build(_ctx())
    resumed.load_state_dict(state)
    assert head + list(resumed) == whole


def test_a_state_of_another_share_is_refused_with_how_to_convert_it():
    state = ShareNode(tp.range(10)._node, Share(2, 0), "data", "drop").build(_ctx()).state_dict()
    other = ShareNode(tp.range(10)._node, Share(2, 1), "data", "drop").build(_ctx())
    with pytest.raises(CheckpointError, match="rank 0 of 2.*rank 1 of 2.*reshard_states"):
        other.load_state_dict(state)


class OtherRanks:
    """The agreement of this rank with ranks whose passes have ``lengths`` elements."""

    def __init__(self, *lengths: int) -> None:
        self.lengths, self.step, self.calls = lengths, 0, 0

    def _others(self) -> list[bool]:
        return [self.step < length for length in self.lengths]

    def all(self, value: bool) -> bool:
        return self._agreed(all([value, *self._others()]))

    def any(self, value: bool) -> bool:
        return self._agreed(any([value, *self._others()]))

    def _agreed(self, answer: bool) -> bool:
        self.step, self.calls = self.step + 1, self.calls + 1
        return answer


def _equalized(
    total: int, uneven: str, target: int | None = None, agreement: Any = None
) -> list[int]:
    return list(EqualizeNode(tp.range(total)._node, uneven, target, agreement).build(_ctx()))


def test_drop_ends_every_rank_with_the_shortest():
    assert _equalized(5, "drop", agreement=OtherRanks(3, 7)) == [0, 1, 2]
    assert _equalized(5, "drop", target=4) == [0, 1, 2, 3]


def test_pad_runs_as_long_as_the_longest_repeating_this_ranks_pass():
    assert _equalized(3, "pad", agreement=OtherRanks(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert _equalized(3, "pad", target=5) == [0, 1, 2, 0, 1]


def test_after_the_ranks_agree_to_stop_no_further_collective_is_made():
    ranks = OtherRanks(2)
    it = EqualizeNode(tp.range(2)._node, "drop", None, ranks).build(_ctx())
    assert list(it) == [0, 1] and ranks.calls == 3
    with pytest.raises(StopIteration):
        next(it)
    assert ranks.calls == 3


def test_a_padding_rank_resumes_exactly_from_its_state():
    node = EqualizeNode(tp.range(3)._node, "pad", 8)
    whole = list(node.build(_ctx()))
    first = node.build(_ctx())
    head = [next(first) for _ in range(4)]  # past the end of its own pass: padding
    resumed = node.build(_ctx())
    resumed.load_state_dict(first.state_dict())
    assert head + list(resumed) == whole == [0, 1, 2, 0, 1, 2, 0, 1]


def test_an_empty_share_cannot_pad_and_says_so():
    with pytest.raises(RuntimeError, match="share is empty"):
        _equalized(0, "pad", target=2)


def test_an_equalizer_without_a_target_or_an_agreement_is_refused():
    with pytest.raises(RuntimeError, match="agreement was not set up"):
        _equalized(3, "drop")

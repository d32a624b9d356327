"""Elastic resume: one epoch's checkpoints of N ranks, converted for M ranks."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torchpipe.core.node import Node, node_classes
from torchpipe.distributed.nodes import SHARE_STATE_KEYS, EqualizeNode
from torchpipe.errors import CheckpointError


# -- elastic resume -----------------------------------------------------------------------------------
def allowed_above() -> set[str]:
    """The op kinds that may sit above the share node of a pipeline whose states reshard: none
    holds elements between two of its outputs (``Node.holds_no_elements``), so what a rank
    consumed is what its share node passed; and the equalizer, whose counts a new rank starts afresh."""
    return _kinds(lambda cls: cls.holds_no_elements) | {EqualizeNode.kind}


def allowed_below() -> set[str]:
    """The op kinds that may sit below it: an index source (``Node.seekable``) and the ops that
    only reorder or select its elements (``Node.reorders_only``), which every rank runs alike (the
    same state at the same position)."""
    return _kinds(lambda cls: cls.seekable or cls.reorders_only)


def _kinds(trait: Callable[[type[Node]], bool]) -> set[str]:
    """The kinds of the op classes with ``trait`` that a checkpoint names (``ops`` records kinds:
    a kind two classes share is allowed where one has the trait; the test of the traits shows
    that those that reach a state agree)."""
    named = [cls for cls in node_classes() if hasattr(cls, "kind")]  # abstract bases have no kind
    return {cls.kind for cls in named if not cls.checkpoints_as_input and trait(cls)}


_LOG_KEYS = {"input", "seq", "skip"}
_EQUALIZE_KEYS = {"input", "yielded", "wraps"}


def reshard_states(states: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """Checkpoints of one epoch taken on N ranks, converted for ``world_size`` ranks.

    Each new rank resumes the epoch without an element of it being lost or repeated: the
    elements any old rank had are left out, and the rest are split between the new ranks as a
    fresh epoch would split them. The pipeline must be split with ``level='data'`` over an index
    source (``from_dataset``, ``range``, ``from_tensor_slices``, after ``shuffle``/``take``/
    ``skip``/``repeat``) and hold no elements above the split (``map``, ``filter``, ``batch``,
    ``padded_batch``, ``ignore_errors``, ``to_device`` and prefetches; parallel maps in order).

    Args:
        states: ``state_dict()`` of every old rank's pass (one each, in any order), taken at
            the same step as far as the training loop goes.
        world_size: the new number of ranks.

    Returns:
        The state for each new rank, by rank: rank ``r`` loads ``result[r]`` into ``iter(ds)``.

    Raises:
        CheckpointError: for states that are not one epoch of every old rank of one pipeline, or
            of a pipeline that cannot be resharded (the message says why).
        ValueError: for a ``world_size`` below 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"reshard_states: world_size must be an int >= 1, got {world_size!r}")
    olds = _old_shares(states)
    origin, holes = olds[0].share["origin"], set(olds[0].share["holes"])
    resume = min(old.share["position"] for old in olds)
    world = len(olds)
    had = {q for q in holes if q >= resume}
    for old in olds:
        had.update(old.own_positions(resume, origin, holes, world))
    base = next(old for old in olds if old.share["position"] == resume)
    return [base.for_rank(rank, world_size, resume, sorted(had)) for rank in range(world_size)]


@dataclasses.dataclass
class _OldShare:
    """One old rank's state, with the path to its share node's."""

    state: dict[str, Any]
    path: list[Any]
    share: dict[str, Any]

    def own_positions(self, start: int, origin: int, holes: set[int], world: int) -> list[int]:
        """The input positions at or past ``start`` whose elements this rank had."""
        rank, end = self.share["rank"], self.share["position"]
        eligible = start - origin - sum(1 for q in holes if q < start)
        own = []
        for q in range(start, end):
            if q in holes:
                continue
            if eligible % world == rank:
                own.append(q)
            eligible += 1
        return own

    def for_rank(self, rank: int, world_size: int, resume: int, holes: list[int]) -> dict[str, Any]:
        state = copy.deepcopy(self.state)
        parent, node = state, state["pipeline"]
        for key in self.path:
            if isinstance(node, dict) and set(node) >= _EQUALIZE_KEYS:
                node["yielded"], node["wraps"] = (
                    0,
                    0,
                )  # the new ranks' passes are as long as each other's
            parent, node = node, node[key]
        share = dict(
            input=node["input"],
            position=resume,
            world_size=world_size,
            rank=rank,
            num_workers=1,
            worker=0,
            origin=resume,
            holes=holes,
            pad=[],
            padded=False,
        )
        parent[self.path[-1] if self.path else "pipeline"] = share
        return state


def _old_shares(states: Sequence[dict[str, Any]]) -> list[_OldShare]:
    if isinstance(states, dict) or not isinstance(states, Sequence) or not states:
        raise CheckpointError("reshard_states: expected a list of the old ranks' states")
    olds = []
    for i, state in enumerate(states):
        if not isinstance(state, dict) or state.get("format") != 3 or "pipeline" not in state:
            raise CheckpointError(
                f"reshard_states: states[{i}] is not a torchpipe pipeline state (format 3)"
            )
        paths = list(_share_paths(state["pipeline"], []))
        if len(paths) != 1:
            raise CheckpointError(
                f"reshard_states: states[{i}] has {len(paths)} share nodes; it must have one "
                "(a pipeline split between ranks, from a rank's own process)"
            )
        share = _follow(state["pipeline"], paths[0])
        olds.append(_OldShare(state, paths[0], share))
    _check_same_epoch(olds)
    _check_ops(olds[0].state["ops"])
    for old in olds:
        _check_nothing_held(old)
    return sorted(olds, key=lambda old: old.share["rank"])


def _share_paths(node: Any, path: list[Any]) -> Any:
    if isinstance(node, dict):
        if set(SHARE_STATE_KEYS) <= set(node):
            yield path
            return
        for key, value in node.items():
            yield from _share_paths(value, path + [key])
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _share_paths(value, path + [i])


def _follow(node: Any, path: list[Any]) -> Any:
    for key in path:
        node = node[key]
    return node


def _check_same_epoch(olds: list[_OldShare]) -> None:
    first = olds[0]
    for key in ("ops", "seed", "epoch"):
        if any(old.state.get(key) != first.state.get(key) for old in olds):
            raise CheckpointError(
                f"reshard_states: the states differ in {key!r}: they are not one pass of one pipeline"
            )
    worlds = {old.share["world_size"] for old in olds}
    ranks = sorted(old.share["rank"] for old in olds)
    if worlds != {len(olds)} or ranks != list(range(len(olds))):
        raise CheckpointError(
            f"reshard_states: expected one state from each of the old ranks; got ranks {ranks} "
            f"of world sizes {sorted(worlds)}"
        )
    if any(old.share["num_workers"] != 1 for old in olds):
        raise CheckpointError(
            "reshard_states: states taken in torch DataLoader workers cannot be resharded"
        )
    for key in ("origin", "holes"):
        if any(old.share[key] != first.share[key] for old in olds):
            raise CheckpointError(
                f"reshard_states: the states' share nodes differ in {key!r}: not one pass"
            )
    if any(not isinstance(old.share["position"], int) for old in olds):
        raise CheckpointError("reshard_states: a shard's 'position' is not an int")


def _check_ops(ops: Any) -> None:
    written = ops[: ops.index("->")] if isinstance(ops, list) and "->" in ops else None
    lines = [line for line in written or [] if line.startswith("distribute(")]
    if written is None or len(lines) != 1:
        raise CheckpointError("reshard_states: the states' 'ops' do not name one share node")
    at = written.index(lines[0])
    if "level='data'" not in lines[0]:
        raise CheckpointError(
            f"reshard_states: the pipeline is split as {lines[0]}; only level='data' (the "
            "elements of an index source) reshards"
        )
    sides = (
        (written[:at], allowed_above(), "above"),
        (written[at + 1 :], allowed_below(), "below"),
    )
    for line, allowed, where in sides:
        for op in line:
            if op.split("(", 1)[0] not in allowed:
                raise CheckpointError(
                    f"reshard_states: {op} {where} the share node holds or makes elements a "
                    f"resharded rank could not take over; allowed {where} it: "
                    f"{sorted(allowed)}"
                )


def _check_nothing_held(old: _OldShare) -> None:
    node: Any = old.state["pipeline"]
    for key in old.path:
        if isinstance(node, dict) and set(node) >= _LOG_KEYS and node["skip"]:
            raise CheckpointError(
                f"reshard_states: rank {old.share['rank']}'s parallel map delivered elements out of order "
                "(deterministic=False); reshard states taken with deterministic=True"
            )
        if isinstance(node, dict) and set(node) >= _EQUALIZE_KEYS and node["wraps"]:
            raise CheckpointError(
                f"reshard_states: rank {old.share['rank']} was already padding the end of its epoch with repeated "
                "elements: nothing is left to reshard; start the next epoch on the new ranks instead"
            )
        node = node[key]

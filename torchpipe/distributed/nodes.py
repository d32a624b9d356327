"""Ops that split a pipeline between ranks: the share node, the read moved above it, the equalizer.

The graph rewrite that places them is ``distributed/ranks.py``; what they need from
``torch.distributed`` (a rank's agreement with the others) is passed in, from
``torchpipe/distributed/``.

The share node numbers the elements of its input that are split ("eligible": all of them, except,
after an elastic resume, those some rank already had) and gives eligible element ``e`` to rank
``e % world_size``; a rank's ``j``-th element goes to its torch DataLoader worker ``j %
num_workers``. Where the input's length is known it also makes the ranks' shares equal, as
``DistributedSampler`` does: ``"drop"`` leaves out the last ``E % world_size`` eligible elements,
``"pad"`` gives each rank short of one the eligible element ``(e - E) % E`` again at its end.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.errors import CheckpointError
from torchpipe.ops.source_nodes import DatasetFetch


@dataclasses.dataclass(frozen=True)
class Share:
    """One share of a stream split between ranks and, within a rank, its torch DataLoader workers.

    Attributes:
        world_size: the number of ranks.
        rank: this rank.
        num_workers: the torch DataLoader workers the rank's share is split between (1: none).
        worker: this worker.
    """

    world_size: int
    rank: int
    num_workers: int = 1
    worker: int = 0

    @property
    def shares(self) -> int:
        """How many shares the stream is split into: ranks x workers."""
        return self.world_size * self.num_workers

    def owns(self, index: int) -> bool:
        """Whether element ``index`` of the split stream is this share's: ranks take turns, and a
        rank's elements go to its workers in turn (so a rank's share is the same with or without
        workers)."""
        n = self.world_size
        return index % n == self.rank and (index // n) % self.num_workers == self.worker

    def count(self, stop: int) -> int:
        """How many of the elements ``0 .. stop - 1`` are this share's."""
        in_rank = max(0, -(-(stop - self.rank) // self.world_size))
        return max(0, -(-(in_rank - self.worker) // self.num_workers))

    def too_few_files(self, count: int) -> str:
        """Why ``count`` files cannot be split into :attr:`shares` shares of whole files (fewer)."""
        return (
            f"{count} files for {self.world_size} ranks x {self.num_workers} workers: each needs at least "
            "one file; give more files, or split the elements with DistributeOptions(policy='data') (or 'auto')"
        )

    def describe(self) -> str:
        """Which share this is, in words: ``rank 1 of 4`` (``x torch worker 0 of 2``)."""
        text = f"rank {self.rank} of {self.world_size}"
        return (
            text
            if self.num_workers == 1
            else f"{text} x torch worker {self.worker} of {self.num_workers}"
        )


@dataclasses.dataclass(frozen=True)
class ShareLimits:
    """Where a share stops, for a stream of ``eligible`` elements (None: unknown or infinite).

    Attributes:
        stop: eligible elements at or past this index are not read (None: read to the end).
        pad_from: the eligible element this share yields again at its end (``"pad"``), or None.
    """

    stop: int | None
    pad_from: int | None

    @staticmethod
    def of(eligible: int | None, share: Share, uneven: str) -> ShareLimits:
        if eligible is None or uneven == "allow":
            return ShareLimits(None, None)
        n = share.world_size
        if uneven == "drop":
            return ShareLimits(n * (eligible // n), None)
        short = eligible % n  # ranks from this one on are one short
        if not short or share.rank < short or (eligible // n) % share.num_workers != share.worker:
            return ShareLimits(eligible, None)
        return ShareLimits(eligible, (share.rank + n * (eligible // n) - eligible) % eligible)

    def count(self, share: Share, eligible: int) -> int:
        """The share's length."""
        stop = eligible if self.stop is None else self.stop
        return share.count(stop) + (self.pad_from is not None)


class ShareNode(Node):
    """This rank's (and torch worker's) share of its input, with equal shares where it can.

    Args:
        input: the node whose elements are split.
        share: which share.
        level: where it was placed, for ``explain()`` and checkpoints: ``"data"`` (the
            elements of one source, after the ops that only reorder or select them), ``"file"``
            (the file names of ``tp.list_files``) or ``"output"``.
        uneven: ``DistributeOptions.uneven``; the shares are made equal here where the input's
            length is known and ``level`` is not ``"file"`` (dropping or repeating whole files
            would lose or repeat far more than an element).
    """

    kind = "distribute"

    def __init__(self, input: Node, share: Share, level: str, uneven: str) -> None:
        super().__init__(input)
        self.share = share
        self.level = level
        self.uneven = uneven

    def params(self) -> dict[str, Any]:
        return {"level": self.level, "uneven": self.uneven}

    def label(self) -> str:
        return f"{super().label()} [{self.share.describe()}]"

    def _total(self) -> int | None:
        n = self.inputs[0].cardinality()
        return None if n in (INFINITE, UNKNOWN) else n

    def cardinality(self) -> int:
        total = self._total()
        if total is None:
            return self.inputs[0].cardinality()
        return ShareLimits.of(total, self.share, self._uneven_here()).count(self.share, total)

    def _uneven_here(self) -> str:
        return "allow" if self.level == "file" else self.uneven

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        # Below the split every rank must draw alike (the same order to split): no rank salt.
        return dataclasses.replace(ctx, salt=())

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        return ShareIterator(self.kind, source, self.share, self._total(), self._uneven_here())


SHARE_STATE_KEYS = (
    "input",
    "position",
    "world_size",
    "rank",
    "num_workers",
    "worker",
    "origin",
    "holes",
    "pad",
    "padded",
)
"""The keys of a share node's state (``tp.distributed.reshard_states`` finds it by them)."""


class ShareIterator(Iterator):
    """Yields its share of the input, skipping (without reading, where the input can seek) the rest.

    State: ``position`` (input elements passed), the share it is (``world_size``, ``rank``,
    ``num_workers``, ``worker``), ``origin`` and ``holes`` (after an elastic resume: the split
    starts at input element ``origin`` and leaves out ``holes``, the elements some rank already
    had), and the element kept to pad with (``pad``, a list of at most one; ``padded``: given).
    """

    INPUT, POSITION, ORIGIN, HOLES, PAD, PADDED = (
        "input",
        "position",
        "origin",
        "holes",
        "pad",
        "padded",
    )

    def __init__(
        self, name: str, source: Iterator, share: Share, total: int | None, uneven: str
    ) -> None:
        super().__init__(name, source)
        self._source = source
        self._share = share
        self._total = total
        self._uneven = uneven
        self._position = 0
        self._eligible = 0  # eligible input elements passed
        self._origin = 0
        self._holes: tuple[int, ...] = ()
        self._hole_set: frozenset[int] = frozenset()
        self._pad: list[Any] = []
        self._padded = False
        self._limits = self._limits_now()

    def _limits_now(self) -> ShareLimits:
        if self._total is None:
            return ShareLimits(None, None)
        eligible = self._total - self._origin - sum(1 for hole in self._holes if hole < self._total)
        return ShareLimits.of(max(0, eligible), self._share, self._uneven)

    def next(self) -> Any:
        share, limits, source = self._share, self._limits, self._source
        while limits.stop is None or self._eligible < limits.stop:
            position, e = self._position, self._eligible
            if position in self._hole_set:
                if not self._pass(source):
                    break
                self._position = position + 1
                continue
            mine, keep = share.owns(e), e == limits.pad_from and not self._pad
            if not (mine or keep):
                if not self._pass(source):
                    break
                self._position, self._eligible = position + 1, e + 1
                continue
            try:
                element = next(source)
            except StopIteration:
                break
            except Exception:
                self._position, self._eligible = (
                    position + 1,
                    e + 1,
                )  # the element that raised took its place
                if mine:
                    raise
                continue  # the pad's source failed: another rank's element, its error that rank's
            self._position, self._eligible = position + 1, e + 1
            if keep:
                self._pad = [element]
            if mine:
                return element
        return self._end()

    @staticmethod
    def _pass(source: Iterator) -> bool:
        """Skip another share's element; False at the end of the input."""
        try:
            source.skip()
        except StopIteration:
            return False
        except Exception:  # noqa: BLE001 - another share's element: its error is that share's
            pass
        return True

    def _end(self) -> Any:
        if self._limits.pad_from is None or self._padded:
            raise StopIteration
        if not self._pad:
            raise RuntimeError(
                f"{self.name}: {self._share.describe()} pads its share with eligible element "
                f"{self._limits.pad_from}, which raised an error when read"
            )
        self._padded = True
        return self._pad[0]

    def get_state(self) -> dict[str, Any]:
        share = self._share
        return {
            self.INPUT: self._source.state_dict(),
            self.POSITION: self._position,
            "world_size": share.world_size,
            "rank": share.rank,
            "num_workers": share.num_workers,
            "worker": share.worker,
            self.ORIGIN: self._origin,
            self.HOLES: list(self._holes),
            self.PAD: list(self._pad),
            self.PADDED: self._padded,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, *SHARE_STATE_KEYS)
        self._check_share(state)
        origin = check_int(self.name, state, self.ORIGIN, minimum=0)
        position = check_int(self.name, state, self.POSITION, minimum=origin)
        holes, pad = state[self.HOLES], state[self.PAD]
        if not isinstance(holes, list) or not all(
            isinstance(h, int) and h >= origin for h in holes
        ):
            raise CheckpointError(
                f"{self.name}: state['holes'] must be a list of positions >= origin, got {holes!r}"
            )
        if not isinstance(pad, list) or len(pad) > 1:
            raise CheckpointError(
                f"{self.name}: state['pad'] must be a list of at most one element"
            )
        padded = check_bool(self.name, state, self.PADDED)
        self._source.load_state_dict(state[self.INPUT])
        self._origin, self._position, self._pad, self._padded = origin, position, list(pad), padded
        self._holes = tuple(sorted(set(holes)))
        self._hole_set = frozenset(self._holes)
        self._eligible = position - origin - sum(1 for hole in self._holes if hole < position)
        self._limits = self._limits_now()

    def _check_share(self, state: dict[str, Any]) -> None:
        keys = ("world_size", "rank", "num_workers", "worker")
        saved = Share(*(check_int(self.name, state, key, minimum=0) for key in keys))
        if saved != self._share:
            raise CheckpointError(
                f"{self.name}: the state is {saved.describe()}'s and this is {self._share.describe()}: each rank "
                "loads its own state; to resume on another number of ranks, convert the states with "
                "tp.distributed.reshard_states(states, world_size)"
            )


class SplitFilesNode(Node):
    """Where a list of files is split between ranks (``tp.io.split_files``, ``tp.from_webdataset``).

    The split itself is the share node that the distribution rewrite puts right below this node
    (``distributed/ranks.py``), so it follows ``DistributeOptions`` (the policy, an explicit rank
    and world size) and splits ranks x torch DataLoader workers once. The node has no iterator of
    its own: where the pipeline is not split between ranks (one process, ``policy="off"``, a split
    placed elsewhere) every file passes.

    Args:
        input: a node of file names, the same list on every rank.
        shuffled: the names were shuffled with the pipeline seed: every rank needs the same one
            (rank 0's, broadcast, where the pipeline has none).
        split: False marks files that every rank reads whole
            (``from_webdataset(split_by_rank=False)``): under ``policy="auto"`` the pipeline is
            then not split.
    """

    kind = "split_files"
    checkpoints_as_input = True

    def __init__(self, input: Node, shuffled: bool, split: bool = True) -> None:
        super().__init__(input)
        self.shuffled = shuffled
        self.split = split

    def params(self) -> dict[str, Any]:
        return {"shuffled": self.shuffled, "split": self.split}

    def is_asynchronous(self) -> bool:
        return self.inputs[0].is_asynchronous()

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx  # a mark, not a stage: the seeds below are the same with and without it

    def build(self, ctx: BuildContext) -> Iterator:
        return ctx.build_input(self)


class FetchNode(Node):
    """``dataset[i]`` for every index of its input: a ``from_dataset`` source's reads, moved above
    the share node so that each rank reads only its share. It checkpoints as its input."""

    kind = "fetch"
    checkpoints_as_input = True

    def __init__(self, input: Node, dataset: Any) -> None:
        super().__init__(input)
        self.dataset = dataset

    def params(self) -> dict[str, Any]:
        return {"dataset": type(self.dataset).__name__}

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx

    def build(self, ctx: BuildContext) -> Iterator:
        fetch = DatasetFetch(self.dataset)
        return FetchIterator(fetch.stage, ctx.build_input(self), fetch)


class FetchIterator(Iterator):
    """Reads ``dataset[i]`` for each index its input yields; skipping reads nothing."""

    def __init__(self, name: str, source: Iterator, fetch: DatasetFetch) -> None:
        super().__init__(name, source)
        self._source = source
        self._fetch = fetch

    def next(self) -> Any:
        return self._fetch(next(self._source))

    def skip(self) -> None:
        self._source.skip()

    def get_state(self) -> dict[str, Any]:
        return self._source.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self._source.load_state_dict(state)


class Agreement(Protocol):
    """The ranks' agreement, one step at a time (``torchpipe.distributed.collectives.PassGroup``)."""

    def all(self, value: bool) -> bool:
        """Whether ``value`` is true on every rank (a collective: every rank calls it)."""

    def any(self, value: bool) -> bool:
        """Whether ``value`` is true on some rank (a collective: every rank calls it)."""


class EqualizeNode(Node):
    """Its input, made as long on this rank as on every other.

    Args:
        input: the pipeline (with its share node).
        uneven: ``"drop"``: end with the shortest rank; ``"pad"``: run as long as the longest,
            repeating this rank's elements from the start of its pass.
        target: the length every rank's pass gets, where each rank's is known; None: the ranks
            agree at every element whether to go on (``agreement``).
        agreement: the ranks' agreement (with ``target=None``); set for each pass.
    """

    kind = "equalize"

    def __init__(
        self, input: Node, uneven: str, target: int | None, agreement: Agreement | None = None
    ) -> None:
        super().__init__(input)
        self.uneven = uneven
        self.target = target
        self.agreement = agreement

    def params(self) -> dict[str, Any]:
        return {"uneven": self.uneven}

    def label(self) -> str:
        how = (
            f"{self.target} elements"
            if self.target is not None
            else "the ranks agree at each element"
        )
        return f"{super().label()} [{how}]"

    def cardinality(self) -> int:
        return self.target if self.target is not None else UNKNOWN

    def input_context(self, ctx: BuildContext, index: int) -> BuildContext:
        return ctx

    def build(self, ctx: BuildContext) -> Iterator:
        if self.target is None and self.agreement is None:
            raise RuntimeError("equalize: the ranks' agreement was not set up for this pass")
        return EqualizeIterator(self, ctx)


class EqualizeIterator(Iterator):
    """See :class:`EqualizeNode`. State: the input's (of its current pass: a ``"pad"`` rank that
    ran out starts it again), how many elements it yielded, and how many times it started again.
    """

    INPUT, YIELDED, WRAPS = "input", "yielded", "wraps"

    def __init__(self, node: EqualizeNode, ctx: BuildContext) -> None:
        self._node = node
        self._ctx = node.input_context(ctx, 0)
        self._source = node.inputs[0].build(self._ctx)
        super().__init__(node.kind, self._source)
        self._yielded = 0
        self._wraps = 0
        self._ended = False  # no collective after the ranks agreed to stop

    def next(self) -> Any:
        if self._ended:
            raise StopIteration
        if self._node.target is not None:
            if self._yielded >= self._node.target:
                raise StopIteration
            element = self._padding() if self._wraps else self._pull_or_pad()
        else:
            element = self._agreed_next()
        self._yielded += 1
        return element

    def _pull_or_pad(self) -> Any:
        try:
            return next(self._source)
        except StopIteration:
            if self._node.uneven == "drop":
                raise
            return self._padding()

    def _agreed_next(self) -> Any:
        node, element, error = self._node, None, None
        has = False
        if not self._wraps:  # a padding rank has nothing of its own left
            try:
                element, has = next(self._source), True
            except StopIteration:
                pass
            except Exception as e:  # noqa: BLE001 - an element that raised still takes its step, so ranks stay in step
                error, has = e, True
        assert node.agreement is not None  # checked at build: no target, so an agreement
        go_on = node.agreement.all(has) if node.uneven == "drop" else node.agreement.any(has)
        if not go_on:
            self._ended = True
            raise StopIteration
        if error is not None:
            raise error
        return element if has else self._padding()

    def _padding(self) -> Any:
        """The next element of this rank's pass started again (again where that one ends)."""
        if self._wraps:
            try:
                return next(self._source)
            except StopIteration:
                pass
        self._restart(self._wraps + 1)
        try:
            return next(self._source)
        except StopIteration:
            raise RuntimeError(
                f"{self.name}: this rank's share is empty: it has nothing to pad its pass with"
            ) from None

    def _restart(self, wraps: int) -> None:
        self._source.close()
        self._source = self._node.inputs[0].build(self._ctx)
        self.inputs = [self._source]
        self._wraps = wraps

    def get_state(self) -> dict[str, Any]:
        return {
            self.INPUT: self._source.state_dict(),
            self.YIELDED: self._yielded,
            self.WRAPS: self._wraps,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INPUT, self.YIELDED, self.WRAPS)
        yielded = check_int(self.name, state, self.YIELDED, minimum=0)
        wraps = check_int(self.name, state, self.WRAPS, minimum=0)
        if wraps:
            self._restart(wraps)
        self._source.load_state_dict(state[self.INPUT])
        self._yielded, self._wraps = yielded, wraps

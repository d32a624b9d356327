"""Ops that keep some elements by position: ``take``, ``skip`` and ``shard``."""

from __future__ import annotations

from typing import Any

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.arguments import require_int
from torchpipe.core.iterator import Iterator, PassThroughIterator
from torchpipe.core.node import BuildContext, Node


class TakeNode(Node):
    """The first ``count`` elements (``-1``: all)."""

    kind = "take"
    reorders_only = True

    def __init__(self, input: Node, count: int) -> None:
        super().__init__(input)
        self.count = count

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n == UNKNOWN:
            return UNKNOWN
        if n == INFINITE:
            return self.count
        return n if self.count < 0 else min(n, self.count)

    def build(self, ctx: BuildContext) -> Iterator:
        return TakeIterator(self.kind, ctx.build_input(self), self.count)


class TakeIterator(PassThroughIterator):
    COUNTERS = ("taken",)

    def __init__(self, name: str, source: Iterator, count: int) -> None:
        super().__init__(name, source)
        self._count = count
        self._taken = 0

    def next(self) -> Any:
        if 0 <= self._count <= self._taken:
            raise StopIteration
        element = next(self._source)
        self._taken += 1
        return element


class SkipNode(Node):
    """All but the first ``count`` elements (``-1``: skip everything)."""

    kind = "skip"
    reorders_only = True

    def __init__(self, input: Node, count: int) -> None:
        super().__init__(input)
        self.count = count

    def params(self) -> dict[str, Any]:
        return {"count": self.count}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        return 0 if self.count < 0 else max(0, n - self.count)

    def build(self, ctx: BuildContext) -> Iterator:
        return SkipIterator(self.kind, ctx.build_input(self), self.count)


class SkipIterator(PassThroughIterator):
    COUNTERS = ("skipped",)

    def __init__(self, name: str, source: Iterator, count: int) -> None:
        super().__init__(name, source)
        self._count = count
        self._skipped = 0

    def next(self) -> Any:
        while self._count < 0 or self._skipped < self._count:
            next(self._source)
            self._skipped += 1
        return next(self._source)


def check_shard_args(num_shards: Any, index: Any) -> None:
    """Raise at ``shard(...)`` for a ``num_shards`` that is not an int >= 1, or an ``index`` not
    an int in ``[0, num_shards)``."""
    require_int("shard", "num_shards", num_shards, minimum=1)
    require_int("shard", "index", index, minimum=0)
    if index >= num_shards:
        raise ValueError(f"shard: index must be < num_shards ({num_shards}), got {index}")


class ShardNode(Node):
    """Every ``num_shards``-th element, starting at ``index``."""

    kind = "shard"
    reorders_only = True

    def __init__(self, input: Node, num_shards: int, index: int) -> None:
        super().__init__(input)
        self.num_shards = num_shards
        self.index = index

    def params(self) -> dict[str, Any]:
        return {"num_shards": self.num_shards, "index": self.index}

    def cardinality(self) -> int:
        n = self.inputs[0].cardinality()
        if n in (INFINITE, UNKNOWN):
            return n
        return n // self.num_shards + (1 if self.index < n % self.num_shards else 0)

    def build(self, ctx: BuildContext) -> Iterator:
        return ShardIterator(self.kind, ctx.build_input(self), self.num_shards, self.index)


class ShardIterator(PassThroughIterator):
    """Keeps the input elements at positions ``index, index + num_shards, ...``.

    The others are skipped (a source that can seek does not read them), and an error raised by
    one of them is dropped: it belongs to the shard that keeps that element.
    """

    COUNTERS = ("position",)

    def __init__(self, name: str, source: Iterator, num_shards: int, index: int) -> None:
        super().__init__(name, source)
        self._num_shards = num_shards
        self._index = index
        self._position = 0  # input elements consumed

    def next(self) -> Any:
        source = self._source
        while True:
            position = self._position
            if position % self._num_shards == self._index:
                try:
                    element = next(source)
                except StopIteration:
                    raise
                except Exception:
                    self._position = position + 1  # the element that raised took its place
                    raise
                self._position = position + 1
                return element
            try:
                source.skip()
            except StopIteration:
                raise
            except Exception:  # noqa: BLE001 - another shard's element: its error is that shard's
                pass
            self._position = position + 1

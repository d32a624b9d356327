"""Source ops: a map-style dataset, an iterable, tensor slices, a range of integers."""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any, NamedTuple

from torchpipe import nest
from torchpipe.constants import UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node, Symbol, function_name
from torchpipe.core.state import check_int, check_state
from torchpipe.errors import add_note


class IndexedSourceIterator(Iterator):
    """Yields ``get(0), get(1), ..., get(length - 1)``; its state is the next index."""

    INDEX = "index"

    def __init__(self, name: str, length: int, get: Callable[[int], Any]) -> None:
        super().__init__(name)
        self._length = length
        self._get = get
        self._index = 0

    def next(self) -> Any:
        i = self._index
        if i >= self._length:
            raise StopIteration
        self._index = i + 1
        return self._get(i)

    def skip(self) -> None:
        if self._index >= self._length:
            raise StopIteration
        self._index += 1

    @property
    def fetches_together(self) -> bool:
        """Whether :meth:`take` fetches its elements in one call (a dataset's ``__getitems__``)."""
        return type(self._get) is DatasetFetch and self._get.getitems is not None

    def take(self, count: int) -> list[Any]:
        if not self.running:
            self._begin()  # as the first next() does (it raises for a closed iterator)
        start = self._index
        if start >= self._length:
            raise StopIteration
        end = min(start + count, self._length)
        get = self._get
        if get is int:  # the indices of a pushed-down source, a batch at once
            self._index = end
            elements: list[Any] = list(range(start, end))
        elif type(get) is DatasetFetch:
            t0 = time.perf_counter()
            elements = self._fetch_many(get, start, end)
            self.stats.clocked_together(t0, time.perf_counter())
        else:
            return super().take(count)
        self.stats.produced += len(elements)
        return elements

    def _fetch_many(self, fetch: DatasetFetch, start: int, end: int) -> list[Any]:
        """Elements ``start`` to ``end`` of a dataset: one ``__getitems__`` call where it has it
        (a failure then consumes them all), else ``dataset[i]`` each, a failure leaving the
        index past the failing one (as :meth:`next` does)."""
        if fetch.getitems is not None:
            self._index = end
            return fetch.many(list(range(start, end)))
        elements: list[Any] = []
        try:
            fetch.each(range(start, end), elements)
        finally:  # past the last fetched, and past one that failed
            self._index = min(start + len(elements) + 1, end)
        return elements

    def get_state(self) -> dict[str, Any]:
        return {self.INDEX: self._index}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.INDEX)
        self._index = check_int(self.name, state, self.INDEX, minimum=0, maximum=self._length)


class DatasetFetch:
    """``dataset[i]`` as the ``from_dataset`` stage fetches it, inline or in a map's workers
    (source pushdown): an exception gets a note naming the stage and the index.

    Args:
        dataset: the map-style dataset.
    """

    __slots__ = ("dataset", "stage", "getitems")

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.stage = (
            getattr(dataset, "torchpipe_stage", None) or f"from_dataset({type(dataset).__name__})"
        )
        # torch's batched fetch, where it has one
        self.getitems = getattr(dataset, "__getitems__", None)

    def __call__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as e:
            add_note(e, f"raised in torchpipe stage {self.stage} at index {index}")
            raise

    def each(self, indices: Iterable[int], out: list[Any]) -> None:
        """Append ``dataset[i]`` for each of ``indices`` to ``out`` (what :meth:`__call__` does,
        without a call of ours a row): a failure leaves the elements before it in ``out``."""
        dataset, append, index = self.dataset, out.append, None
        try:
            for index in indices:
                append(dataset[index])
        except Exception as e:
            add_note(e, f"raised in torchpipe stage {self.stage} at index {index}")
            raise

    def many(self, indices: list[int]) -> list[Any]:
        """The elements at ``indices``, with one ``__getitems__`` call where the dataset has it."""
        if self.getitems is None:
            out: list[Any] = []
            self.each(indices, out)
            return out
        try:
            return list(self.getitems(indices))
        except Exception as e:
            shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
            add_note(
                e,
                f"raised in torchpipe stage {self.stage} at one of indices [{shown}] (__getitems__)",
            )
            raise


class FromDatasetNode(Node):
    """``dataset[i]`` for every index of a map-style dataset."""

    kind = "from_dataset"
    seekable = True

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.dataset = dataset

    def params(self) -> dict[str, Any]:
        return {"dataset": type(self.dataset).__name__, "len": len(self.dataset)}

    def cardinality(self) -> int:
        return len(self.dataset)

    def build(self, ctx: BuildContext) -> Iterator:
        fetch = DatasetFetch(self.dataset)
        return IndexedSourceIterator(fetch.stage, len(self.dataset), fetch)


class IndicesNode(Node):
    """The indices ``0 .. len(dataset) - 1`` of a map-style dataset whose fetch the optimizer
    pushed into a parallel map (``graph/passes/source_pushdown.py``): it stands where the
    ``from_dataset`` stood, so the ops above it keep their seeds and checkpoints."""

    kind = "from_dataset"
    seekable = True

    def __init__(self, source: FromDatasetNode) -> None:
        super().__init__()
        self.dataset_name = type(source.dataset).__name__
        self.length = len(source.dataset)

    def params(self) -> dict[str, Any]:
        return {"indices of": self.dataset_name, "len": self.length}

    def cardinality(self) -> int:
        return self.length

    def build(self, ctx: BuildContext) -> Iterator:
        return IndexedSourceIterator(self.kind, self.length, int)


class SplitFileList(list):
    """The files ``tp.distributed.share_of_files`` gave one share: a pipeline that starts from them
    is split by hand already, and the distribution rewrite does not split it again.

    Attributes:
        share: the share they are for (a ``distributed.nodes.Share``).
    """

    def __init__(self, files: Any, share: Any) -> None:
        super().__init__(files)
        self.share = share


class TensorSlicesNode(Node):
    """Slices of a structure of tensors, arrays and lists along their first dimension.

    Attributes:
        split_by_hand: why its elements are one share already (a list from
            ``tp.distributed.share_of_files``), or "".
    """

    kind = "from_tensor_slices"
    seekable = True

    def __init__(self, structure: Any, length: int) -> None:
        super().__init__()
        self.structure = structure
        self.length = length
        self._leaves = nest.flatten(structure, lists=False)
        split = any(isinstance(leaf, SplitFileList) for leaf in self._leaves)
        self.split_by_hand = "its files come from tp.distributed.share_of_files" if split else ""

    def params(self) -> dict[str, Any]:
        return {"len": self.length}

    def cardinality(self) -> int:
        return self.length

    def _slice(self, i: int) -> Any:
        return nest.pack_as(self.structure, [leaf[i] for leaf in self._leaves], lists=False)

    def build(self, ctx: BuildContext) -> Iterator:
        return IndexedSourceIterator(self.kind, self.length, self._slice)


class FileListNode(TensorSlicesNode):
    """A list of file names (``tp.list_files``' matches, a file reader's list in ``torchpipe.io``):
    tensor slices of the paths (and checkpointed as such), which the distribution rewrite
    recognizes as a pipeline that starts from files."""

    def __init__(self, files: list[str]) -> None:
        super().__init__(files, len(files))
        self.files = files


class IndexedFiles(NamedTuple):
    """How an opener's files are read by record address (the optimizer's record_pushdown).

    Attributes:
        addresses: maps a file name to the dataset of its records' addresses, in file order,
            with the state the opener's own inner dataset has (so checkpoints are the same).
        fetch: reads records by address, as a map-style dataset does by index
            (``fetch[address]``, and ``fetch.__getitems__(addresses)`` for a batch's).
    """

    addresses: Callable[[Any], Any]
    fetch: Any


class FileOpener:
    """Base of the functions that map a file name to the dataset of its records (``torchpipe.io``'s
    TFRecord and tar readers): a ``flat_map`` or ``interleave`` of one reads files, so the
    distribution rewrite splits its input by file, whatever dataset of names it is given."""

    def indexed(self, paths: list[str]) -> IndexedFiles | None:
        """How files ``paths`` are read by record address, or None where they are not (the
        default): compressed files, or files without ranged reads."""
        return None


def file_opener(fn: Any) -> FileOpener | None:
    """The :class:`FileOpener` that ``fn`` is, or that it opens one file as (a reader function
    such as ``tp.TFRecordDataset`` names it ``__torchpipe_file_opener__``); else None."""
    if isinstance(fn, FileOpener):
        return fn
    opener = getattr(fn, "__torchpipe_file_opener__", None)
    return opener if isinstance(opener, FileOpener) else None


class RangeNode(Node):
    """Python ints ``start, start + step, ...`` short of ``stop``."""

    kind = "range"
    seekable = True

    def __init__(self, start: int, stop: int, step: int) -> None:
        super().__init__()
        self.values = builtins.range(start, stop, step)

    def params(self) -> dict[str, Any]:
        return {"start": self.values.start, "stop": self.values.stop, "step": self.values.step}

    def cardinality(self) -> int:
        return len(self.values)

    def build(self, ctx: BuildContext) -> Iterator:
        return IndexedSourceIterator(self.kind, len(self.values), self.values.__getitem__)


class FromIterableNode(Node):
    """Elements of an iterable, or of what a zero-argument callable returns for each pass."""

    kind = "from_iterable"

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.source = source

    def params(self) -> dict[str, Any]:
        return {
            "source": function_name(self.source)
            if callable(self.source)
            else Symbol(type(self.source).__name__)
        }

    def cardinality(self) -> int:
        if not callable(self.source) and isinstance(self.source, Sized):
            return len(self.source)
        return UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return IterableIterator(self.kind, self.source)


class IterableIterator(Iterator):
    """Iterates a fresh iterable; resumes by re-creating it and skipping what was consumed."""

    CONSUMED = "consumed"

    def __init__(self, name: str, source: Any) -> None:
        super().__init__(name)
        self._source = source
        self._iterator: Any = None
        self._consumed = 0

    def start(self) -> None:
        made = self._source() if callable(self._source) else self._source
        try:
            self._iterator = iter(made)
        except TypeError as e:
            raise TypeError(
                f"{self.name}: the callable must return an iterable, got {type(made).__name__}"
            ) from e
        for i in builtins.range(self._consumed):
            try:
                next(self._iterator)
            except StopIteration:
                raise RuntimeError(
                    f"{self.name}: cannot resume at element {self._consumed}: the iterable now ends after {i}"
                ) from None

    def next(self) -> Any:
        element = next(self._iterator)
        self._consumed += 1
        return element

    def get_state(self) -> dict[str, Any]:
        return {self.CONSUMED: self._consumed}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.CONSUMED)
        self._consumed = check_int(self.name, state, self.CONSUMED, minimum=0)

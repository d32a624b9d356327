"""``tp.from_ray``: a Ray Dataset (or a Ray Train worker's shard) as a pipeline's source.

The source streams the dataset block by block (``iter_batches(batch_size=None)``: Ray executes
it as the pipeline pulls) and yields its rows as ``iter_rows()`` does: a dict per row, scalar
columns as Python values, tensor columns as numpy arrays. Its checkpoint is a cursor, the rows
delivered so far. A resume starts a new execution of the dataset and moves the cursor over whole
blocks without looking at their rows; a materialized dataset (``ds.materialize()``) is split at
the cursor instead (``split_at_indices``), so its earlier blocks are not even fetched. Ray Data
cannot seek a lazy dataset: its blocks before the cursor are computed again, and a resume is
exact only where the dataset's order is deterministic (torchpipe sets Ray's
``preserve_order`` for the executions it starts). See docs/scale_out.md.

A Ray Train worker's shard (``ray.train.get_dataset_shard(...)``, a ``DataIterator``) is already
that worker's share: the pipeline says so, so that on several ranks ``DistributeOptions``
``"auto"`` does not split it again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchpipe.constants import UNKNOWN
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node, Symbol
from torchpipe.core.state import check_int, check_state
from torchpipe.dataset import Dataset
from torchpipe.runtime.ray.actors import require_ray


def from_ray(dataset: Any) -> Dataset:
    """A pipeline over the rows of a Ray Dataset, or of a Ray Train worker's dataset shard.

    Each pass (epoch) executes the dataset again, streaming, and yields its rows as
    ``iter_rows()`` does; the checkpoint is the number of rows delivered (a resume skips whole
    blocks up to it, or splits a materialized dataset there: docs/scale_out.md says what Ray
    allows). A shard (a ``ray.data.DataIterator``) is one rank's already: it is not split again.

    Args:
        dataset: a ``ray.data.Dataset`` or a ``ray.data.DataIterator``.

    Raises:
        ImportError: if Ray is not installed (naming the extra).
        TypeError: if ``dataset`` is neither.
    """
    require_ray()
    return Dataset(ray_source(dataset))


def ray_source(dataset: Any) -> RayDataNode:
    """The source node of ``tp.from_ray(dataset)`` (:func:`from_ray`, which has made sure Ray is
    installed).

    Raises:
        TypeError: if ``dataset`` is neither a ``ray.data.Dataset`` nor a ``DataIterator``.
    """
    from ray.data import DataIterator
    from ray.data import Dataset as RayDataset

    if not isinstance(dataset, (RayDataset, DataIterator)):
        raise TypeError(
            f"from_ray: expected a ray.data.Dataset or a ray.data.DataIterator (a Ray Train "
            f"worker's dataset shard), got {type(dataset).__name__}"
        )
    return RayDataNode(dataset)


class RayDataNode(Node):
    """The rows of a Ray Dataset or DataIterator, block by block."""

    kind = "from_ray"

    def __init__(self, source: Any) -> None:
        super().__init__()
        from ray.data import DataIterator

        self.source = source
        # A DataIterator is one consumer's share of a dataset (a Ray Train worker's): already split.
        if isinstance(source, DataIterator):
            self.given_share = "its source is a Ray Train worker's dataset shard"

    def params(self) -> dict[str, Any]:
        return {"dataset": Symbol(type(self.source).__name__)}

    def cardinality(self) -> int:
        from ray.data.dataset import MaterializedDataset

        return self.source.count() if isinstance(self.source, MaterializedDataset) else UNKNOWN

    def build(self, ctx: BuildContext) -> Iterator:
        return RayDataIterator(f"from_ray({type(self.source).__name__})", self.source)


class RayDataIterator(Iterator):
    """Streams a Ray Dataset's blocks and yields their rows; its state is the rows delivered."""

    ROWS = "rows"

    def __init__(self, name: str, source: Any) -> None:
        super().__init__(name)
        self._source = source
        self._rows = 0
        self._blocks: Any = None
        self._block: _Block | None = None

    def start(self) -> None:
        source, skip = self._source, self._rows
        if skip and _is_materialized(source):
            source, skip = (
                source.split_at_indices([skip])[1],
                0,
            )  # blocks before the cursor are not fetched
        self._blocks = iter(_batches(source))
        while skip:
            block = self._next_block(skip)
            if len(block) > skip:
                block.index = skip
                self._block = block
                return
            skip -= len(block)

    def next(self) -> Any:
        block = self._block
        while block is None or block.index >= len(block):
            block = self._block = _Block(next(self._blocks))
        row = block.row(block.index)
        block.index += 1
        self._rows += 1
        return row

    def _next_block(self, missing: int) -> _Block:
        try:
            return _Block(next(self._blocks))
        except StopIteration:
            raise RuntimeError(
                f"{self.name}: cannot resume at row {self._rows}: the dataset now ends "
                f"{missing} rows before it"
            ) from None

    def get_state(self) -> dict[str, Any]:
        return {self.ROWS: self._rows}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, self.ROWS)
        self._rows = check_int(self.name, state, self.ROWS, minimum=0)


class _Block:
    """One block's columns, rows taken out as ``iter_rows()`` gives them."""

    __slots__ = ("columns", "length", "index")

    def __init__(self, batch: dict[str, np.ndarray]) -> None:
        # A column of scalars becomes Python values at once (tolist is one C loop a block); a
        # column of arrays is indexed row by row (views of the block).
        self.columns = [
            (name, values.tolist() if values.ndim == 1 else values)
            for name, values in batch.items()
        ]
        self.length = len(next(iter(batch.values()))) if batch else 0
        self.index = 0

    def __len__(self) -> int:
        return self.length

    def row(self, i: int) -> dict[str, Any]:
        return {name: values[i] for name, values in self.columns}


def _batches(source: Any) -> Any:
    """The source's blocks as numpy batches, in a deterministic order where Ray allows it."""
    context = getattr(source, "context", None)
    if context is not None:  # a Dataset's own context: the executions it starts keep the order
        context.execution_options.preserve_order = True
    return source.iter_batches(batch_size=None, batch_format="numpy")


def _is_materialized(source: Any) -> bool:
    from ray.data.dataset import MaterializedDataset

    return isinstance(source, MaterializedDataset)

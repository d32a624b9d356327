"""Interleave readers on Ray actors: ``interleave(fn, ..., executor="ray")``.

The process readers' protocol as it is (``ops/interleave/process_readers.py``): each open inner dataset is
read chunk by chunk through the dispatcher, two chunks out, a chunk task naming the reader and the
chunk's number, so an actor that still has the inner iterator open reads on from it, and any other
(after a resize, or an actor Ray restarted) opens it at the saved position, or answers stale where
the chunk goes on after one whose state it was sent without. Only the pool differs: the chunk task
is pickled once to a :class:`~torchpipe.runtime.ray.pool.RayActorPool` (which the stage's
``tp.RayExecutor`` makes: nothing here imports Ray), each actor reads one chunk at a time (a
reader's second chunk runs after its first), and chunks come back through Ray's object store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchpipe.ops.interleave.chunk_task import InnerChunkTask
from torchpipe.ops.interleave.process_readers import ProcessReaders
from torchpipe.ops.interleave.readers import InnerOpener
from torchpipe.runtime.placement.costs import RAY

if TYPE_CHECKING:
    from torchpipe.runtime.ray.executor import RayExecutor


class RayReaders(ProcessReaders):
    """Reads the open inner datasets ahead on Ray actors, chunk by chunk; ``parallelism`` is
    the number of actors.

    Args:
        name: the stage name.
        opener: builds an inner iterator (pickled to the actors with the chunk task).
        block_length: the interleave's; a chunk holds at least one block.
        restart: replace dead actors (else ``WorkerError``).
        stall_s: ``Options.stall_timeout``: a chunk out this long raises ``StallError``.
        options: the actors' options (a ``tp.RayExecutor``, which makes the pool).
    """

    kind = RAY

    def __init__(
        self,
        name: str,
        opener: InnerOpener,
        block_length: int,
        restart: bool,
        stall_s: float | None,
        options: RayExecutor,
    ) -> None:
        super().__init__(name, opener, block_length, restart, stall_s)
        self._options = options

    def _make_pool(self, task: InnerChunkTask) -> Any:
        return self._options.pool(
            task, 0, self.name, restart=self._restart, timing=self.stats.calls
        )

    def report(self) -> dict[str, Any]:
        return (
            {"workers": self._pool.size} if self._pool is not None else {}
        )  # actors: no pids, no threads

    def resize(self, parallelism: int) -> None:
        if self._reading:
            assert self._pool is not None  # reading: prepared
            self._pool.resize(parallelism)  # an actor reads one chunk at a time: no threads to set

"""Writer threads that encode elements and append them to the shards of a saved dataset.

Shard ``s`` is written by thread ``s % threads`` alone, so each shard's records keep the order in
which they were added, and encoding (pickling, copying tensor bytes, CRCs, compression) runs off
the thread that produces the elements. ``save`` and ``snapshot`` both write through this class.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from torchpipe.errors import add_note
from torchpipe.runtime import codec
from torchpipe.storage.cache_file import Origin
from torchpipe.storage.element_spec import element_spec, merge_specs
from torchpipe.storage.saved_file import ShardFile, compress, shard_name

_QUEUE = 64  # elements waiting per writer thread: enough to ride out a slow write
_POLL_S = 0.5
_JOIN_S = 5.0


class _Drain:
    """Asks a writer thread to hand its files' contents to the kernel (or the disk) and say so."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.done = threading.Event()


class ShardWriters:
    """Shards written in parallel, one writer thread for each (up to ``threads``).

    Args:
        directory: where the shard files go.
        generation: the save's generation (part of every file name).
        origin, pipeline: the header of every shard file (the pass and the pipeline's fingerprint).
        compression: ``None``, ``"GZIP"`` or ``"ZLIB"`` (each record on its own).
        threads: writer threads.
        resumed: shards reopened at a checkpoint, by number.
        spec: the element spec of the elements written before that checkpoint.
        stage: names the writer in errors, e.g. ``save(/data/train)``.
    """

    def __init__(
        self,
        directory: str,
        generation: str,
        origin: Origin,
        pipeline: list[str],
        compression: str | None,
        threads: int,
        resumed: dict[int, ShardFile] | None = None,
        spec: Any = None,
        stage: str = "save",
    ) -> None:
        self._directory, self._generation = directory, generation
        self._origin, self._pipeline, self._compression = origin, pipeline, compression
        self._stage = stage
        self._files: dict[int, ShardFile] = dict(resumed or {})
        self._specs: list[Any] = [spec] + [None] * (threads - 1)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._queues: list[queue.Queue] = [queue.Queue(_QUEUE) for _ in range(threads)]
        self._threads = [
            threading.Thread(
                target=self._run, args=(slot,), name=f"torchpipe-{stage}-writer-{slot}", daemon=True
            )
            for slot in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def add(self, shard: int, index: int, element: Any) -> None:
        """Queue ``element`` (element ``index`` of the dataset) for shard ``shard``.

        Raises:
            Exception: what a writer thread raised (an element that cannot be pickled, a full
                disk), with a note naming the element and the shard.
        """
        self._put(self._queues[shard % len(self._queues)], (shard, index, element))

    def _put(self, target: queue.Queue, item: Any) -> None:
        while True:
            self._raise_error()
            try:
                target.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if not all(thread.is_alive() for thread in self._threads):
                    raise RuntimeError(
                        f"{self._stage}: a writer thread ended unexpectedly"
                    ) from None

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def drain(self, sync: bool) -> None:
        """Wait until every element added so far is written and flushed (with ``sync``, on disk)."""
        marks = [_Drain(sync) for _ in self._queues]
        for target, mark in zip(self._queues, marks):
            self._put(target, mark)
        for thread, mark in zip(self._threads, marks):
            while not mark.done.wait(_POLL_S):
                if not thread.is_alive():
                    raise RuntimeError(f"{self._stage}: a writer thread ended unexpectedly")
        self._raise_error()

    def positions(self) -> dict[int, tuple[int, int]]:
        """``{shard: (bytes, records)}`` of every shard; call after :meth:`drain`."""
        return {shard: (file.offset, file.count) for shard, file in self._files.items()}

    @property
    def spec(self) -> Any:
        """The element spec of every element written; call after :meth:`drain`."""
        merged = None
        for spec in self._specs:
            merged = merge_specs(merged, spec)
        return merged

    def finish(self) -> list[dict[str, Any]]:
        """Drain, finish every shard (footers, final names) and stop the threads.

        Returns:
            The shards' manifest entries, by shard number (shards that got no element are absent).
        """
        self.drain(sync=False)
        entries = [dict(self._files[shard].finish(), shard=shard) for shard in sorted(self._files)]
        self._files = {}
        self.close()
        return entries

    def close(self) -> None:
        """Stop the threads; shard files not finished stay as partial files (a save may resume them)."""
        self._stop.set()
        for target in self._queues:  # wakes an idle thread now rather than at its next poll
            try:
                target.put_nowait(None)
            except queue.Full:
                pass
        for thread in self._threads:
            thread.join(timeout=_JOIN_S)
        for file in self._files.values():
            file.close()
        self._files = {}

    # -- the writer threads ---------------------------------------------------------------------
    def _run(self, slot: int) -> None:
        source = self._queues[slot]
        while not self._stop.is_set():
            try:
                item = source.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, _Drain):
                self._flush(slot, item)
            elif self._error is None:  # after an error, elements are dropped: the write has failed
                self._write(slot, *item)

    def _flush(self, slot: int, mark: _Drain) -> None:
        try:
            for shard, file in list(self._files.items()):
                if shard % len(self._queues) == slot:
                    file.flush(mark.sync)
        except Exception as e:  # noqa: BLE001 - raised on the producer's thread
            add_note(e, f"raised in torchpipe {self._stage} while flushing its shards")
            self._error = e
        finally:
            mark.done.set()

    def _write(self, slot: int, shard: int, index: int, element: Any) -> None:
        try:
            payload = compress(codec.encode_bytes(element), self._compression)
            file = self._files.get(shard)
            if file is None:
                file = ShardFile.create(
                    self._directory,
                    shard_name(self._generation, shard),
                    self._origin,
                    self._pipeline,
                    self._stage,
                )
                self._files[shard] = file
            file.add(index, payload)
            self._specs[slot] = merge_specs(self._specs[slot], element_spec(element))
        except Exception as e:  # noqa: BLE001 - raised on the producer's thread
            add_note(
                e,
                f"raised in torchpipe {self._stage} while writing element {index} to shard {shard}",
            )
            self._error = e

"""``ds.save(path)``: a pipeline's output written once, for ``tp.load(path)`` (``saved.py``) to read.

``save`` runs one pass over the dataset and writes its elements to shards on writer threads
(:mod:`torchpipe.storage.save_writers`; format in :mod:`torchpipe.storage.saved_file`, ``docs/save.md``).
Every few seconds it drains the writers and records a checkpoint in ``progress.pkl``: the
pipeline iterator's state, each shard's length and the element count. A save that is killed is
resumed by saving the same pipeline to the same directory again: the shards are cut back to the
checkpoint, the iterator resumes there, and only the rest is computed. The manifest is written
last, so a reader never sees a half-written dataset. The checkpoint is read back with the
restricted unpickler (:mod:`torchpipe.runtime.codec.restricted`): a ``progress.pkl`` someone else
put in the directory runs no code; one naming a type outside the allow-list raises
:class:`~torchpipe.errors.UntrustedTypeError`. A save that runs out of room raises
:class:`~torchpipe.errors.DiskFullError` (naming the file and the bytes written) and removes its
files and checkpoint, which hold the room the disk lacks; a dataset saved there before stays.
"""

from __future__ import annotations

import os
import pickle
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchpipe.errors import CheckpointError, DiskFullError, UntrustedTypeError, add_note
from torchpipe.observe.progress import ProgressBar
from torchpipe.runtime.codec import restricted
from torchpipe.runtime.cpu import usable_cpu_count
from torchpipe.storage.fingerprint import describe_ops, function_digest
from torchpipe.storage.pending_file import write_file
from torchpipe.storage.save_writers import ShardWriters
from torchpipe.storage.saved_file import (
    FORMAT,
    FORMAT_VERSION,
    SavedFormatError,
    ShardFile,
    lock_directory,
    new_generation,
    read_manifest,
    remove_files,
    shard_name,
    sync_directory,
    write_manifest,
)

PROGRESS = "progress.pkl"
DEFAULT_CHECKPOINT_S = 5.0
CHECKPOINT_KEYS = ("checkpoint_interval", "checkpoint_interval_s")


def save(
    dataset: Any,
    path: str,
    shard_func: Callable[..., Any] | None = None,
    compression: str | None = None,
    checkpoint_interval: int | None = None,
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_S,
) -> None:
    """Write one pass over ``dataset`` to ``path`` (see ``tp.Dataset.save``, which checks the arguments).

    Raises:
        RuntimeError: if another process is saving to ``path`` right now.
        UntrustedTypeError: if ``path`` holds a checkpoint (``progress.pkl``) naming a type
            outside the allow-list (nothing of it ran).
        DiskFullError: if the disk is full (or a file would pass ``RLIMIT_FSIZE``); this save's
            files are removed and a dataset saved there before stays.
    """
    os.makedirs(path, exist_ok=True)
    lock = lock_directory(path)
    if lock is None:
        raise RuntimeError(f"save: another process is saving to {path!r} right now")
    try:
        _Save(
            dataset, path, shard_func, compression, checkpoint_interval, checkpoint_interval_s
        ).run()
    finally:
        lock.close()


class _Save:
    """One save: its job description (what a resume must match), the pass, the checkpoints."""

    def __init__(
        self,
        dataset: Any,
        path: str,
        shard_func: Callable[..., Any] | None,
        compression: str | None,
        every: int | None,
        every_s: float,
    ) -> None:
        self.dataset, self.path, self.shard_func, self.compression = (
            dataset,
            path,
            shard_func,
            compression,
        )
        self.every, self.every_s = every, every_s
        self.stage = f"save({path})"
        self.pipeline = describe_ops(dataset._node, code=True)
        self.threads = usable_cpu_count()
        self.job = {
            "pipeline": self.pipeline,
            "compression": compression,
            "threads": self.threads,
            "shard_func": None if shard_func is None else function_digest(shard_func),
        }

    def run(self) -> None:
        iterator = iter(self.dataset)
        try:
            progress = self._resumable()
            generation, count, writers = self._start(iterator, progress)
            try:
                count = self._write(iterator, writers, generation, count)
                entries = writers.finish()
            finally:
                writers.close()
            self._publish(generation, count, entries, writers.spec, iterator)
        except DiskFullError:
            self._discard_partial()  # its files hold the room the disk lacks: a resume could not go on
            raise
        finally:
            iterator.close()

    def _resumable(self) -> dict[str, Any] | None:
        """The checkpoint of an interrupted save of this job, or None."""
        path = os.path.join(self.path, PROGRESS)
        try:
            with open(path, "rb") as f:
                progress = restricted.loads(f.read())
        except FileNotFoundError:
            return None
        except UntrustedTypeError as e:
            add_note(
                e,
                f"{self.stage}: reading the checkpoint {path!r} of an interrupted save; delete it to save "
                "from the start",
            )
            raise
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint: start afresh
            warnings.warn(
                f"{self.stage}: its checkpoint cannot be read ({e!r}); saving from the start",
                stacklevel=4,
            )
            return None
        if not isinstance(progress, dict) or progress.get("job") != self.job:
            warnings.warn(
                f"{self.stage}: an interrupted save of another pipeline (or other arguments) is there; "
                "it is discarded and this one saves from the start",
                stacklevel=4,
            )
            return None
        return progress

    def _start(
        self, iterator: Any, progress: dict[str, Any] | None
    ) -> tuple[str, int, ShardWriters]:
        """The generation, the elements already written and the writers: resumed where possible."""
        if progress is not None:
            try:
                resumed = {
                    shard: ShardFile.resume(
                        self.path,
                        shard_name(progress["generation"], shard),
                        offset,
                        count,
                        self.pipeline,
                        self.stage,
                    )
                    for shard, (offset, count) in progress["shards"].items()
                }
                iterator.load_state_dict(progress["state"])
            except (SavedFormatError, CheckpointError) as e:
                warnings.warn(
                    f"{self.stage}: cannot resume the interrupted save ({e}); saving from the start",
                    stacklevel=4,
                )
            else:
                writers = self._writers(progress["generation"], iterator, resumed, progress["spec"])
                return progress["generation"], progress["count"], writers
        self._discard_partial()
        generation = new_generation()
        return generation, 0, self._writers(generation, iterator, {}, None)

    def _writers(
        self, generation: str, iterator: Any, resumed: dict[int, ShardFile], spec: Any
    ) -> ShardWriters:
        state = iterator.state_dict()
        origin = (state["seed"], state["epoch"], ())
        return ShardWriters(
            self.path,
            generation,
            origin,
            self.pipeline,
            self.compression,
            self.threads,
            resumed,
            spec,
            self.stage,
        )

    def _discard_partial(self) -> None:
        """Remove an interrupted save's files, keeping the published dataset's."""
        try:
            keep = read_manifest(self.path)["generation"]
        except (FileNotFoundError, SavedFormatError, KeyError):
            keep = None
        remove_files(self.path, keep)
        if os.path.exists(os.path.join(self.path, PROGRESS)):
            os.remove(os.path.join(self.path, PROGRESS))

    def _write(self, iterator: Any, writers: ShardWriters, generation: str, count: int) -> int:
        total = self.dataset.cardinality()
        last = time.monotonic()
        with ProgressBar(self.stage, total, initial=count) as bar:
            for element in iterator:
                writers.add(self._shard(element, count), count, element)
                count += 1
                bar.update()
                due = (
                    count % self.every == 0
                    if self.every is not None
                    else time.monotonic() - last >= self.every_s
                )
                if due:
                    self._checkpoint(iterator, writers, generation, count)
                    last = time.monotonic()
        return count

    def _shard(self, element: Any, index: int) -> int:
        if self.shard_func is None:
            return index % self.threads
        try:
            shard = (
                self.shard_func(*element) if type(element) is tuple else self.shard_func(element)
            )
        except Exception as e:
            add_note(e, f"raised in torchpipe {self.stage}'s shard_func at element {index}")
            raise
        if isinstance(shard, torch.Tensor) and shard.numel() == 1 and not shard.is_floating_point():
            shard = shard.item()
        if isinstance(shard, bool) or not hasattr(shard, "__index__") or int(shard) < 0:
            raise ValueError(
                f"{self.stage}: shard_func must return an int >= 0, got {shard!r} for element {index}"
            )
        return int(shard)

    def _checkpoint(
        self, iterator: Any, writers: ShardWriters, generation: str, count: int
    ) -> None:
        """Drain the writers to the disk and record where the pass is (atomically)."""
        writers.drain(sync=True)
        progress = {
            "job": self.job,
            "generation": generation,
            "count": count,
            "state": iterator.state_dict(),
            "shards": writers.positions(),
            "spec": writers.spec,
        }
        write_file(
            os.path.join(self.path, PROGRESS),
            pickle.dumps(progress, protocol=pickle.HIGHEST_PROTOCOL),
            self.stage,
        )
        sync_directory(self.path)

    def _publish(
        self, generation: str, count: int, entries: list[dict[str, Any]], spec: Any, iterator: Any
    ) -> None:
        state = iterator.state_dict()
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "generation": generation,
            "count": count,
            "compression": self.compression,
            "element_spec": spec,
            "pipeline": self.pipeline,
            "origin": [state["seed"], state["epoch"], []],
            "shards": entries,
        }
        write_manifest(self.path, manifest, self.stage)
        remove_files(self.path, generation)
        if os.path.exists(os.path.join(self.path, PROGRESS)):
            os.remove(os.path.join(self.path, PROGRESS))


def check_checkpoint_args(checkpoint_args: Any) -> dict[str, Any]:
    """``checkpoint_args`` as ``save``'s keyword arguments.

    Raises:
        TypeError, ValueError: for an unknown key or a value of the wrong type or range.
    """
    if checkpoint_args is None:
        return {}
    if not isinstance(checkpoint_args, dict):
        raise TypeError(
            f"save: checkpoint_args must be a dict or None, got {type(checkpoint_args).__name__}"
        )
    unknown = sorted(set(checkpoint_args) - set(CHECKPOINT_KEYS))
    if unknown:
        raise TypeError(
            f"save: unknown checkpoint_args {unknown}; expected some of {list(CHECKPOINT_KEYS)}"
        )
    every = checkpoint_args.get("checkpoint_interval")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"save: checkpoint_interval must be an int >= 1 (elements), got {every!r}")
    every_s = checkpoint_args.get("checkpoint_interval_s", DEFAULT_CHECKPOINT_S)
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not every_s > 0:
        raise ValueError(
            f"save: checkpoint_interval_s must be a positive number of seconds, got {every_s!r}"
        )
    return {"checkpoint_interval": every, "checkpoint_interval_s": float(every_s)}

"""``cache``: keep the elements of the first complete pass, in memory or in a file.

The first pass that runs to its end stores its elements; every later pass over the same node
(another ``iter()``, the next repetition under ``repeat``, a pipeline built on top) replays them
without running anything upstream. A pass that stops early stores nothing. As in tf.data, an
element whose computation raised is passed on as an error but not stored. The file format and
its writer and reader are in ``cache_file.py``; ``docs/cache.md`` describes both.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import threading
from typing import Any, cast

import numpy as np
import torch

from torchpipe import nest
from torchpipe.core.arguments import require_bool
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.errors import CheckpointError, add_note
from torchpipe.storage.cache_file import (
    CacheFormatError,
    FileStorage,
    Origin,
    StaleCacheWarning,
    origin_of,
)
from torchpipe.storage.fingerprint import describe_ops

__all__ = [
    "CacheFormatError",
    "CacheIterator",
    "CacheNode",
    "MemoryStore",
    "StaleCacheWarning",
    "check_cache_args",
    "check_cache_path",
]


# -- in memory -------------------------------------------------------------------------------------
class MemoryStore:
    """A node's in-memory cache: the elements of the first complete pass, shared by its iterators.

    Elements are kept as they are (not copied): a consumer must not modify them in place.
    Pickling or copying a node gives an empty store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._elements: list[Any] | None = None
        self._origin: Origin | None = None

    def get(self) -> tuple[list[Any], Origin] | None:
        with self._lock:
            return (
                None if self._elements is None else (self._elements, cast(Origin, self._origin))
            )  # set together

    def offer(self, elements: list[Any], origin: Origin) -> None:
        """Store a complete pass unless another complete pass was stored first."""
        with self._lock:
            if self._elements is None:
                self._elements, self._origin = elements, origin

    def replay(self, origin: Origin | None, state: dict[str, Any] | None) -> _MemoryReplay | None:
        """A replay of the stored pass (if it is ``origin``'s), at ``state``'s position."""
        stored = self.get()
        if stored is None or (origin is not None and stored[1] != origin):
            return None
        position = 0 if state is None else int(state[_MemoryReplay.POSITION])
        return _MemoryReplay(*stored, position) if position <= len(stored[0]) else None

    def recorder(self, origin: Origin) -> _MemoryRecorder:
        return _MemoryRecorder(self, origin)

    def resume_recorder(self, state: dict[str, Any]) -> None:
        """A fill cannot go on in memory after a resume: its first part is gone."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]  # this class's own __init__


class _MemoryReplay:
    """Replays a stored list from a position."""

    POSITION = "position"

    def __init__(self, elements: list[Any], origin: Origin, position: int) -> None:
        self._elements = elements
        self.origin = origin
        self.position = position

    def next(self) -> Any:
        if self.position >= len(self._elements):
            raise StopIteration
        self.position += 1
        return self._elements[self.position - 1]

    def state(self) -> dict[str, Any]:
        return {self.POSITION: self.position}

    def close(self) -> None:
        self._elements = []


def owned(element: Any) -> Any:
    """``element`` with tensors that borrow memory (views of a worker's shared-memory ring, or
    of numpy arrays) copied: kept for the whole run, they would pin that memory (a full ring
    slows its worker down to one-off segments)."""
    leaves = nest.flatten(element)
    if not any(_borrows(x) for x in leaves):
        return element
    return nest.pack_as(
        element,
        [
            x.copy() if isinstance(x, np.ndarray) else x.clone() if _borrows(x) else x
            for x in leaves
        ],
    )


def _borrows(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return not x.untyped_storage().resizable()
    return isinstance(x, np.ndarray) and not x.flags.owndata


class _MemoryRecorder:
    """Collects a filling pass's elements and offers them to the store at the end."""

    WRITTEN = "written"

    def __init__(self, store: MemoryStore, origin: Origin) -> None:
        self._store = store
        self._origin = origin
        self._elements: list[Any] = []

    def add(self, element: Any) -> None:
        self._elements.append(owned(element))

    def state(self) -> dict[str, Any]:
        return {self.WRITTEN: len(self._elements)}

    def commit(self) -> None:
        self._store.offer(self._elements, self._origin)

    def discard(self) -> None:
        self._elements = []


# -- the op ----------------------------------------------------------------------------------------
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def check_cache_args(path: Any, trusted: Any) -> None:
    """Raise at ``cache(...)`` for a ``path`` that is not a str, os.PathLike or None, a ``trusted``
    not a bool, or a file no pass could write (:func:`check_cache_path`)."""
    if path is not None and not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise TypeError(
            f"cache: path must be a str, os.PathLike or None, got {type(path).__name__}"
        )
    require_bool("cache", "trusted", trusted)
    check_cache_path(path)


def check_cache_path(path: str | bytes | os.PathLike | None) -> None:
    """Raise at ``cache(path)`` for a file that no pass could write or read.

    Checked with the local file system only: a cache is a local file (locked, written to a
    temporary name and linked into place), so a URL is refused rather than looked up. A
    directory that is not writable is an error only while there is no file to replay yet.

    Args:
        path: the cache file; ``None`` or ``""`` (memory) is not checked.

    Raises:
        ValueError: for a URL (``s3://...``, ``file://...``).
        IsADirectoryError: if ``path`` is a directory.
        FileNotFoundError: if ``path``'s directory does not exist.
        NotADirectoryError: if ``path``'s directory is a file.
        PermissionError: if no file is at ``path`` and its directory is not writable.
    """
    path = os.fsdecode(os.fspath(path)) if path is not None else None
    if not path:
        return
    if _URL.match(path):
        raise ValueError(
            f"cache: path must be a local file name, got the URL {path!r} (cache files are local)"
        )
    if os.path.isdir(path):
        raise IsADirectoryError(f"cache: path {path!r} is a directory; expected a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(folder):
        raise FileNotFoundError(
            f"cache: cannot write cache file {path!r}: directory {folder!r} does not exist"
        )
    if not os.path.isdir(folder):
        raise NotADirectoryError(
            f"cache: cannot write cache file {path!r}: {folder!r} is not a directory"
        )
    if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(
            f"cache: cannot write cache file {path!r}: directory {folder!r} is not writable"
        )


class CacheNode(Node):
    """The input's elements, stored by the first complete pass and replayed by later ones.

    Args:
        input: the input node.
        path: a file to cache into; ``None`` (or ``""``, as in tf.data) keeps the elements in
            memory. A file keeps the fingerprint of the pipeline above the cache (functions by
            their code); a pass that finds a file of another pipeline rebuilds it.
        trusted: read the file's records with full pickle, not the restricted unpickler.
    """

    kind = "cache"

    def __init__(self, input: Node, path: str | os.PathLike | None, trusted: bool = False) -> None:
        super().__init__(input)
        self.path: str | None = os.fsdecode(os.fspath(path)) if path is not None else None
        if self.path == "":
            self.path = None
        if self.path is None:
            self.storage: MemoryStore | FileStorage = MemoryStore()
        else:
            self.storage = FileStorage(
                self.path, describe_ops(input, code=True), input.cardinality(), trusted
            )
        self.name = "cache" if self.path is None else f"cache({self.path})"

    def params(self) -> dict[str, Any]:
        return {"path": self.path if self.path is not None else "memory"}

    def build(self, ctx: BuildContext) -> Iterator:
        return CacheIterator(self, ctx)


class CacheIterator(Iterator):
    """Replays the node's stored elements, or runs the input and stores what it yields.

    What a pass does is decided when it starts (so a pass built before another one completes
    still replays it). Modes: ``read`` replays; ``fill`` runs the input and records; ``pass``
    runs the input without recording (a resumed fill whose first part is gone); ``end``.
    A checkpoint of a replay is its position; if the stored elements are gone when it is
    resumed, the pass that stored them is rebuilt (same seed, epoch and repetition), its
    first ``position`` elements stored but not yielded, and its errors dropped as a replay
    would.

    The input's iterator is built with this one (an iterator does nothing before its first
    element) and is a child only while it runs, so that every state has the same keys: the
    input's state is there in every mode, as it stands (filling) or as it was when the pass
    stopped running it (replaying: as built; ended: at its end).
    """

    MODE, INPUT, SKIP, QUIET, ORIGIN = "mode", "input", "skip", "quiet", "origin"
    POSITION, OFFSET, WRITTEN, TEMP = "position", "offset", "written", "temp"
    KEYS = (MODE, ORIGIN, INPUT, SKIP, QUIET, POSITION, OFFSET, WRITTEN, TEMP)
    FRESH, READ, FILL, PASS, END = "fresh", "read", "fill", "pass", "end"

    def __init__(self, node: CacheNode, ctx: BuildContext) -> None:
        super().__init__(node.name)
        self._node = node
        self._ctx = ctx
        self._mode = self.FRESH
        self._pending: dict[str, Any] | None = None
        self._origin: Origin = (ctx.seed, ctx.epoch, tuple(ctx.iteration))
        self._source: Iterator | None = ctx.build_input(node)
        self._parked: dict[str, Any] | None = None  # the input's state once it no longer runs
        self._replay: Any = None
        self._recorder: Any = None
        self._skip = 0  # elements still to store without yielding
        self._quiet = False  # drop upstream errors (rebuilding a replay, which had none)

    def children(self) -> list[Iterator]:
        return (
            [self._source]
            if self._mode in (self.FILL, self.PASS) and self._source is not None
            else []
        )

    # -- starting a pass ------------------------------------------------------------------------
    def start(self) -> None:
        state, self._pending = self._pending, None
        self._mode = self.END  # if opening fails, the error is raised once and the pass ends
        if state is None or state[self.MODE] == self.FRESH:
            self._open(self._node.storage.replay(None, None), self._origin, 0, quiet=False)
            return
        mode = state[self.MODE]
        if mode == self.READ:
            origin = origin_of(state[self.ORIGIN])
            replay = self._node.storage.replay(origin, state)
            self._open(replay, origin, int(state[self.POSITION]), quiet=True)
        elif mode in (self.FILL, self.PASS):
            self._resume_upstream(state)
        else:
            self._park(state[self.INPUT])

    def _open(self, replay: Any, origin: Origin, skip: int, quiet: bool) -> None:
        if replay is not None:
            self._replay, self._origin, self._mode = replay, replay.origin, self.READ
            assert self._source is not None  # parked once, here
            self._park(self._source.state_dict())
            return
        self._rebuild_source(origin)
        self._skip, self._quiet = skip, quiet
        self._recorder = self._node.storage.recorder(origin)
        self._mode = self.FILL

    def _resume_upstream(self, state: dict[str, Any]) -> None:
        self._rebuild_source(origin_of(state[self.ORIGIN]))
        # built with this iterator, parked only once it stops running
        assert self._source is not None
        self._source.load_state_dict(state[self.INPUT])
        self._skip, self._quiet = int(state[self.SKIP]), bool(state[self.QUIET])
        if state[self.MODE] == self.FILL:
            self._recorder = self._node.storage.resume_recorder(state)
        self._mode = self.FILL if self._recorder is not None else self.PASS

    def _rebuild_source(self, origin: Origin) -> None:
        """The input as the pass ``origin`` names builds it (this pass's unless it rebuilds another's)."""
        if origin == self._origin:
            return
        seed, epoch, iteration = origin
        # built with this iterator, parked only once it stops running
        assert self._source is not None
        self._source.close()
        self._source = dataclasses.replace(
            self._ctx, seed=seed, epoch=epoch, iteration=iteration
        ).build_input(self._node)
        self._origin = origin

    def _park(self, input_state: dict[str, Any]) -> None:
        self._parked = copy.deepcopy(input_state)
        assert self._source is not None  # built with this iterator, parked only once
        self._source.close()
        self._source = None

    # -- elements -------------------------------------------------------------------------------
    def next(self) -> Any:
        if self._mode == self.READ:
            return self._replay.next()
        if self._mode == self.END:
            raise StopIteration
        source = self._source
        assert source is not None  # filling or passing: the input runs
        while True:
            try:
                element = next(source)
            except StopIteration:
                self._complete()
                raise
            except Exception:
                if self._quiet:
                    continue
                raise
            if self._recorder is not None:
                self._record(element)
            if self._skip > 0:
                self._skip -= 1
                continue
            return element

    def _record(self, element: Any) -> None:
        try:
            self._recorder.add(element)
        except Exception as e:
            self._stop_recording(e)
            raise

    def _recorder_state(self) -> dict[str, Any]:
        try:
            return self._recorder.state()  # flushes: a full disk can raise here too
        except Exception as e:
            self._stop_recording(e)
            raise

    def _stop_recording(self, error: Exception) -> None:
        """After ``error`` (a full disk, an element that cannot be stored) the pass goes on, storing nothing."""
        self._recorder.discard()
        self._recorder, self._mode = None, self.PASS
        add_note(
            error,
            f"raised in torchpipe stage {self.name} while storing an element; this pass stores nothing",
        )

    def _complete(self) -> None:
        recorder, self._recorder = self._recorder, None
        self._mode = self.END
        if recorder is not None:
            try:
                recorder.commit()
            except Exception as e:
                recorder.discard()
                add_note(e, f"raised in torchpipe stage {self.name} while storing the cache")
                raise

    # -- checkpoints ----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        state = dict.fromkeys(self.KEYS)
        state.update(
            {
                self.MODE: self._mode,
                self.ORIGIN: [self._origin[0], self._origin[1], list(self._origin[2])],
                self.INPUT: self._source.state_dict()
                if self._source is not None
                else copy.deepcopy(self._parked),
                self.SKIP: self._skip,
                self.QUIET: self._quiet,
            }
        )
        if self._replay is not None and self._mode == self.READ:
            state.update(self._replay.state())
        if self._recorder is not None:
            state.update(self._recorder_state())
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self.name, state, *self.KEYS)
        mode = state[self.MODE]
        if mode not in (self.FRESH, self.READ, self.FILL, self.PASS, self.END):
            raise CheckpointError(f"{self.name}: state['mode'] is {mode!r}, not a cache mode")
        origin_of(state[self.ORIGIN])
        check_int(self.name, state, self.SKIP, minimum=0)
        check_bool(self.name, state, self.QUIET)
        if mode == self.READ:
            check_int(self.name, state, self.POSITION, minimum=0)
        if not isinstance(state[self.INPUT], dict):
            raise CheckpointError(f"{self.name}: state['input'] must be the input's state dict")
        self._pending = copy.deepcopy(state)

    def shutdown(self) -> None:
        if self._recorder is not None:
            self._recorder.discard()
            self._recorder = None
        if self._replay is not None:
            self._replay.close()
        if self._source is not None:
            self._source.close()

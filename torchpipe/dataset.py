"""``Dataset``: the immutable logical pipeline node and its chain methods.

Chain methods check their arguments and build a node; the checks (``check_*``) and the logic
live with each op in ``ops/<family>.py``.
A ``Dataset`` is a ``torch.utils.data.IterableDataset``, so any torch consumer can iterate it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch

from torchpipe.constants import AUTOTUNE, INFINITE, UNKNOWN
from torchpipe.core.arguments import require_callable, require_int, require_path
from torchpipe.core.node import Node, walk
from torchpipe.distributed.context import current_rank_info
from torchpipe.distributed.workers import current_worker
from torchpipe.graph import PassHistory, PipelineIterator, Plan, explain_plan, plan_facts
from torchpipe.ops.batch import (
    BatchNode,
    PaddedBatchNode,
    RebatchNode,
    UnbatchNode,
    check_batch_args,
    check_rebatch_args,
)
from torchpipe.ops.bucket import BucketBySequenceLengthNode, check_bucket_args
from torchpipe.ops.cache import CacheNode, check_cache_args
from torchpipe.ops.combine import ConcatenateNode, ZipNode
from torchpipe.ops.device import DeviceNode, check_device
from torchpipe.ops.filter import FilterNode, IgnoreErrorsNode, TakeWhileNode
from torchpipe.ops.interleave.interleave import FlatMapNode, InterleaveNode, check_interleave_args
from torchpipe.ops.map import MapNode, check_map_args
from torchpipe.ops.passthrough import WithOptionsNode
from torchpipe.ops.prefetch import PrefetchNode
from torchpipe.ops.repeat import RepeatNode, check_repeat_count
from torchpipe.ops.scan import EnumerateNode, ScanNode
from torchpipe.ops.select import ShardNode, SkipNode, TakeNode, check_shard_args
from torchpipe.ops.shuffle import ShuffleNode, check_shuffle_args
from torchpipe.ops.snapshot import SnapshotNode, check_snapshot_args
from torchpipe.ops.window import WindowNode, check_window_args
from torchpipe.options import Options
from torchpipe.runtime.ray.executor import RayExecutor
from torchpipe.storage.save import check_checkpoint_args, save
from torchpipe.storage.saved_file import check_compression


class Dataset(torch.utils.data.IterableDataset):
    """A pipeline of ops, tf.data style. Build one with ``tp.from_dataset`` and friends.

    Immutable: every chain method returns a new Dataset. ``iter(ds)`` starts a pass and returns
    a checkpointable iterator; each ``iter()`` is a new epoch (random ops reshuffle).
    """

    def __init__(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise TypeError(
                "Datasets are made by tp.from_dataset(), tp.range() and the other sources"
            )
        self._node = node
        self._history = PassHistory()  # the epoch counter, and what the latest pass tuned
        self._latest: weakref.ref | None = None  # the latest pass, for explain()'s tuned values
        self._memory: dict[tuple[int, ...], dict[str, Any]] = {}  # what passes learned, by path

    def __getstate__(self) -> dict[str, Any]:
        # A copy (torch's DataLoader pickles its dataset for spawned workers) starts afresh.
        return {"_node": self._node}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_node"])  # type: ignore[misc]  # this class's own __init__

    # -- iteration and inspection ---------------------------------------------------------
    def __iter__(self) -> PipelineIterator:
        iterator = self._plan().iterator(self._history)
        self._latest = weakref.ref(iterator)
        return iterator

    def _plan(self) -> Plan:
        options = self.options()
        return Plan(
            self._node,
            options,
            self._memory,
            current_worker(self),
            current_rank_info(options.distribute),
        )

    def options(self) -> Options:
        """The pipeline's options: every ``with_options`` below this node, later ones winning."""
        merged = Options()
        for node in walk(self._node, inputs_first=True):
            if isinstance(node, WithOptionsNode):
                merged = merged.merge(node.options)
        return merged

    def cardinality(self) -> int:
        """Number of elements; ``tp.INFINITE`` or ``tp.UNKNOWN`` where that is all one can know.

        On one of several ranks (docs/distributed.md), the number this rank's pass yields.
        """
        if current_rank_info(self.options().distribute) is not None:
            return self._plan().runtime_root.cardinality()
        return self._node.cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n == INFINITE:
            raise TypeError("the dataset is infinite; it has no len()")
        if n == UNKNOWN:
            raise TypeError("the dataset's length is unknown (e.g. after filter); it has no len()")
        return n

    @overload
    def explain(self, as_dict: Literal[False] = False) -> str: ...
    @overload
    def explain(self, as_dict: Literal[True]) -> dict[str, Any]: ...
    def explain(self, as_dict: bool = False) -> str | dict[str, Any]:
        """The pipeline as written and as it will run, one op a line with its parameters,
        a line for each rewrite the static optimizer did, and the values the autotuner chose
        for the latest pass over this Dataset: now while it is alive, as it left them once it
        ended (until a new pass starts).

        Args:
            as_dict: return the same facts as data (which rewrites applied, each op, the tuned
                values): see :func:`torchpipe.graph.explain.plan_facts` for its keys.
        """
        latest = self._latest() if self._latest is not None else None
        tuned = latest.tuned_values() if latest is not None else self._history.last_tuned()
        describe = plan_facts if as_dict else explain_plan
        return describe(self._plan(), tuned, running=latest is not None)

    def __repr__(self) -> str:
        return f"<tp.Dataset {self._node.label()}>"

    # -- element-wise ---------------------------------------------------------------------
    def map(
        self,
        fn: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        executor: str | RayExecutor = "auto",
        name: str | None = None,
        *,
        pure: bool = False,
        batched: bool = False,
    ) -> Dataset:
        """Apply ``fn`` to every element (a plain tuple element is unpacked into arguments).

        Args:
            fn: the function.
            num_parallel_calls: ``None`` runs inline; an int >= 1 or ``tp.AUTOTUNE`` runs that
                many calls at once.
            deterministic: keep input order (default: ``Options.deterministic``).
            executor: ``"thread"`` (shares the GIL; best for functions that release it: PIL,
                numpy, torch ops), ``"process"`` (worker processes, results through shared
                memory; for Python-heavy functions), ``"ray"`` or ``tp.RayExecutor(...)`` (Ray
                actors, on this machine or a cluster: docs/scale_out.md), or ``"auto"``: measure
                the first calls and choose among threads and processes (see docs/executors.md).
            name: the stage name in errors, stats and ``explain()`` (default ``map(<fn name>)``).
            pure: declare that ``fn``'s result depends only on its element (and ``tp.rng()``)
                and that it has no side effects the caller relies on (same as ``@tp.pure``);
                the optimizer then runs a sequential map in parallel (map_parallelization).
            batched: declare that ``fn`` gives the same batch applied to each element before
                collation as applied once to the collated batch; a following ``batch`` then
                runs first and ``fn`` once per batch (vectorize). ``fn`` must not draw
                random numbers.

        Raises:
            TypeError, ValueError: for arguments of the wrong type or range.
        """
        parallel, executor = check_map_args(
            fn, num_parallel_calls, deterministic, executor, name, pure, batched
        )
        node = MapNode(self._node, fn, parallel, deterministic, executor, name, pure, batched)
        return Dataset(node)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keep the elements for which ``predicate`` returns True (a bool or 0-d bool tensor)."""
        require_callable("filter", "predicate", predicate)
        return Dataset(FilterNode(self._node, predicate))

    def flat_map(self, fn: Callable[..., Dataset]) -> Dataset:
        """Map each element to a Dataset with ``fn`` and yield their elements in order."""
        require_callable("flat_map", "fn", fn)
        return Dataset(FlatMapNode(self._node, fn))

    def interleave(
        self,
        fn: Callable[..., Dataset],
        cycle_length: int | None = None,
        block_length: int = 1,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        executor: str | RayExecutor = "auto",
    ) -> Dataset:
        """Map each element to a Dataset and interleave them, tf.data's order.

        ``cycle_length`` inner datasets are open at once; ``block_length`` consecutive elements
        come from each before moving to the next. ``cycle_length=None`` or ``tp.AUTOTUNE``
        uses the number of usable CPU cores, and at least 16 (tf.data takes the cores; 16 keeps
        16 slow reads in flight, docs/autotune.md). With ``num_parallel_calls`` the inner
        datasets are read ahead in parallel; the order stays the same unless
        ``deterministic=False``.

        Args:
            executor: where inner datasets are read in parallel: ``"thread"``, ``"process"``
                (worker processes; for Python-heavy parsing), ``"ray"`` or ``tp.RayExecutor(...)``
                (Ray actors, a read at a time each: docs/scale_out.md), or ``"auto"``, which starts on
                threads and moves the readers to worker processes (one a core, reads on threads
                in each) if they cost 20 us or more of CPU an element (docs/executors.md).
                Only ``tp.rng()`` is reproducible in ``fn`` with threads or ``"auto"``.
        """
        parallel, executor = check_interleave_args(
            fn, cycle_length, block_length, num_parallel_calls, deterministic, executor
        )
        node = InterleaveNode(
            self._node, fn, cycle_length, block_length, parallel, deterministic, executor
        )
        return Dataset(node)

    def scan(self, initial_state: Any, fn: Callable[[Any, Any], tuple[Any, Any]]) -> Dataset:
        """Carry a state through the elements: ``fn(state, element) -> (new_state, output)``."""
        require_callable("scan", "fn", fn)
        return Dataset(ScanNode(self._node, initial_state, fn))

    def enumerate(self, start: int = 0) -> Dataset:
        """Pair each element with its index: ``(start + i, element)``."""
        require_int("enumerate", "start", start)
        return Dataset(EnumerateNode(self._node, start))

    def ignore_errors(self) -> Dataset:
        """Drop elements whose computation raised an exception; they are counted in stats.

        A record of a saved dataset, snapshot or cache that holds a type not allowed
        (``tp.UntrustedTypeError``) is not dropped: it raises, since it is a type to allow
        (``tp.add_safe_globals``), not damaged data.
        """
        return Dataset(IgnoreErrorsNode(self._node))

    # -- batching -------------------------------------------------------------------------
    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Dataset:
        """Combine consecutive elements into batches.

        The default collation keeps the structure (a tuple stays a tuple, a dict a dict),
        stacks tensors and arrays into tensors, turns numbers into tensors and collects strings
        and bytes into lists. ``collate_fn(list_of_elements)`` replaces it.
        """
        check_batch_args("batch", batch_size, drop_remainder, collate_fn)
        return Dataset(BatchNode(self._node, batch_size, drop_remainder, collate_fn))

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Batch elements of different shapes, padding each component.

        Args:
            padded_shapes: a structure like the element's of shapes; ``None`` or ``-1`` in a
                dimension pads it to the longest in the batch, an int pads to exactly that size.
                ``None`` for the whole argument pads every dimension to the batch maximum.
            padding_values: a scalar per component (or one for all); default 0. A number pads a
                tensor, array or number; str and bytes components are collected, not padded.

        Raises:
            TypeError, ValueError: at the call, for a padding value that is not a number, str,
                bytes, 0-d tensor or array, or None; at a pass's first element, before any batch,
                for ``padding_values`` of another structure than the element's, a str padding a
                numeric component, or a number its component's dtype cannot hold.
        """
        check_batch_args("padded_batch", batch_size, drop_remainder)
        return Dataset(
            PaddedBatchNode(self._node, batch_size, padded_shapes, padding_values, drop_remainder)
        )

    def unbatch(self) -> Dataset:
        """Split each element along its first dimension into elements."""
        return Dataset(UnbatchNode(self._node))

    def rebatch(self, batch_size: int | Sequence[int], drop_remainder: bool = False) -> Dataset:
        """Re-split already batched elements into batches of ``batch_size``.

        Equivalent to ``unbatch().batch(batch_size)``; a list of sizes is used in turn.
        """
        sizes = check_rebatch_args(batch_size, drop_remainder)
        return Dataset(RebatchNode(self._node, sizes, drop_remainder))

    def bucket_by_sequence_length(
        self,
        element_length_func: Callable[..., int],
        bucket_boundaries: Sequence[int],
        bucket_batch_sizes: Sequence[int],
        padded_shapes: Any = None,
        padding_values: Any = None,
        pad_to_bucket_boundary: bool = False,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Batch elements of similar length together, padding within each bucket (tf.data's op).

        Bucket ``i`` holds lengths in ``[bucket_boundaries[i-1], bucket_boundaries[i])``; a full
        bucket is emitted as a padded batch, and partial buckets are flushed at the end in
        bucket order.
        """
        bounds, sizes = check_bucket_args(
            element_length_func,
            bucket_boundaries,
            bucket_batch_sizes,
            pad_to_bucket_boundary,
            drop_remainder,
        )
        node = BucketBySequenceLengthNode(
            self._node,
            element_length_func,
            bounds,
            sizes,
            padded_shapes,
            padding_values,
            pad_to_bucket_boundary,
            drop_remainder,
        )
        return Dataset(node)

    def window(
        self, size: int, shift: int | None = None, stride: int = 1, drop_remainder: bool = False
    ) -> Dataset:
        """Group consecutive elements into (possibly overlapping) windows, each a tuple (tf.data's op).

        Window ``i`` holds the input elements ``i * shift + j * stride`` for ``j < size``.
        Without ``drop_remainder`` the windows that the input's end cuts short are kept
        (shorter, never empty); with it, only full windows are. Unlike tf.data, which yields
        each window as a dataset, a window is a tuple of elements, ready for ``map`` (a tuple is
        unpacked into arguments) or ``batch``::

            tp.range(7).window(3, shift=2, drop_remainder=True)  # (0, 1, 2), (2, 3, 4), (4, 5, 6)
            ds.window(4, shift=1).map(lambda *w: torch.stack(w))  # overlapping frames, stacked

        Input elements between two windows (``shift`` larger than a window's span) are skipped
        without being read where the input can seek; an error one of them raises is dropped. An
        error an element of a window raises reaches the caller as the element is read, and the
        windows go on with the elements after it (tf.data keeps its place and raises it for each
        window that holds it).

        The elements the windows in progress hold, at most ``(size - 1) * stride + 1``, are part
        of a checkpoint. On several ranks or torch DataLoader workers the pipeline is split
        below the window, where it starts: each windows its own share (every N-th element). For
        windows of consecutive elements, split the windows instead: ``.window(...).shard(n, i)``.

        Args:
            size: elements in a full window, >= 1.
            shift: input elements from one window's start to the next's, >= 1 (default ``size``).
            stride: input elements from one element of a window to the next, >= 1.
            drop_remainder: keep only windows of ``size`` elements.

        Returns:
            A dataset of tuples of the input's elements.

        Raises:
            TypeError: if ``size``, ``shift`` or ``stride`` is not an int or ``drop_remainder``
                not a bool.
            ValueError: if ``size``, ``shift`` or ``stride`` is below 1.
        """
        size, shift, stride = check_window_args(size, shift, stride, drop_remainder)
        return Dataset(WindowNode(self._node, size, shift, stride, drop_remainder))

    # -- order and size -------------------------------------------------------------------
    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Shuffle with a buffer of ``buffer_size`` elements (tf.data's algorithm).

        The same seed gives the same order; with ``reshuffle_each_iteration`` each epoch and each
        repetition is shuffled differently.
        """
        check_shuffle_args(buffer_size, seed, reshuffle_each_iteration)
        return Dataset(ShuffleNode(self._node, buffer_size, seed, reshuffle_each_iteration))

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat the dataset ``count`` times; ``None`` or -1 repeats forever."""
        return Dataset(RepeatNode(self._node, check_repeat_count(count)))

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements; -1 takes all."""
        require_int("take", "count", count, minimum=-1)
        return Dataset(TakeNode(self._node, count))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements; -1 skips all."""
        require_int("skip", "count", count, minimum=-1)
        return Dataset(SkipNode(self._node, count))

    def take_while(self, predicate: Callable[..., Any]) -> Dataset:
        """Elements up to (not including) the first for which ``predicate`` is False."""
        require_callable("take_while", "predicate", predicate)
        return Dataset(TakeWhileNode(self._node, predicate))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element starting at ``index``."""
        check_shard_args(num_shards, index)
        return Dataset(ShardNode(self._node, num_shards, index))

    # -- combining ------------------------------------------------------------------------
    def zip(self, *others: Dataset) -> Dataset:
        """Tuples of this dataset's elements with the others'; stops at the shortest."""
        for other in others:
            _check_dataset("zip", other)
        return Dataset(ZipNode([self._node, *(o._node for o in others)], None))

    def concatenate(self, other: Dataset) -> Dataset:
        """This dataset's elements followed by ``other``'s."""
        _check_dataset("concatenate", other)
        return Dataset(ConcatenateNode(self._node, other._node))

    # -- execution ------------------------------------------------------------------------
    def cache(self, path: str | None = None, *, trusted: bool = False) -> Dataset:
        """Keep the elements after the first full pass; later passes run nothing upstream.

        ``path=None`` keeps them in memory; a path writes a file (written to a temporary name
        and renamed when the pass completes, so an interrupted pass is never read as complete).

        Security: a file's records are read by a restricted unpickler that rebuilds only plain
        data (None, bool, int, float, complex, str, bytes, tuple, list, dict, OrderedDict, plain
        namedtuples, numpy arrays and scalars, torch tensors) and what ``tp.add_safe_globals``
        allows, so a file someone else put at ``path`` runs no code; another type raises
        :class:`~torchpipe.errors.UntrustedTypeError` naming it (docs/cache.md, "Security").

        Args:
            path: the cache file, or None (memory).
            trusted: read the file with full pickle: any class loads, and the file can run any
                code. Only for a file that no one you do not trust could write.

        Raises:
            TypeError: for a path that is not a str, os.PathLike or None, or ``trusted`` not a bool.
            ValueError, OSError: for a file no pass could write: a URL, a directory, a missing or
                unwritable directory (see :func:`torchpipe.ops.cache.check_cache_path`).
        """
        check_cache_args(path, trusted)
        return Dataset(CacheNode(self._node, path, trusted))

    def save(
        self,
        path: str | os.PathLike,
        *,
        shard_func: Callable[..., Any] | None = None,
        compression: str | None = None,
        checkpoint_args: dict[str, Any] | None = None,
    ) -> None:
        """Write one pass over the dataset to the directory ``path``; ``tp.load(path)`` reads it.

        As tf.data's ``Dataset.save``: the elements go to shard files written in parallel (one
        writer thread a shard), with a manifest (element structure, count, the pipeline's
        fingerprint, format version) written last, so a reader never sees a half-written dataset;
        every record is checksummed. A save that is interrupted (even by SIGKILL) resumes where
        its last checkpoint left it when the same pipeline is saved to ``path`` again. A progress
        bar is drawn on a terminal (docs/save.md).

        Args:
            path: the directory (created if missing); a dataset saved there before is replaced.
            shard_func: maps an element (a plain tuple is unpacked into arguments) to its shard, an
                int >= 0; default: element ``i`` goes to shard ``i % cores``.
            compression: ``None``, ``"GZIP"`` or ``"ZLIB"`` (each record on its own, so reads stay
                random access).
            checkpoint_args: ``{"checkpoint_interval": n}`` checkpoints every ``n`` elements,
                ``{"checkpoint_interval_s": s}`` every ``s`` seconds (default 5).

        Raises:
            TypeError, ValueError: for arguments of the wrong type or value.
            RuntimeError: if another process is saving to ``path``.
        """
        require_path("save", path)
        if shard_func is not None:
            require_callable("save", "shard_func", shard_func)
        compression = check_compression(compression)
        checkpointing = check_checkpoint_args(checkpoint_args)
        save(self, os.fsdecode(os.fspath(path)), shard_func, compression, **checkpointing)

    def snapshot(
        self, path: str | os.PathLike, *, compression: str | None = None, trusted: bool = False
    ) -> Dataset:
        """The input's elements, written under ``path`` by the first job that runs this pipeline
        and read from there by later jobs (tf.data's ``snapshot``).

        The snapshot's directory is named by a fingerprint of the pipeline above it (its ops,
        parameters and functions' code), so a changed pipeline writes a new one. The first
        complete pass writes it (on writer threads, while the pass is consumed) and publishes it
        when it ends; later passes, in this job or another, read it and run nothing upstream.
        Of jobs filling the same snapshot at once, one writes and the others compute without
        writing (docs/save.md).

        Security: the directory is named by a hash anyone can compute, so whoever can write under
        ``path`` could plant one. Its records are read by a restricted unpickler that rebuilds only
        plain data (None, bool, int, float, complex, str, bytes, tuple, list, dict, OrderedDict,
        plain namedtuples, numpy arrays and scalars, torch tensors) and what
        ``tp.add_safe_globals`` allows: another type raises
        :class:`~torchpipe.errors.UntrustedTypeError` naming it, and nothing of it runs
        (docs/save.md, "Security").

        Args:
            path: the directory that holds snapshots (created if missing).
            compression: ``None``, ``"GZIP"`` or ``"ZLIB"``.
            trusted: read the snapshot with full pickle: any class loads, and a planted snapshot
                can run any code. Only for a ``path`` that no one you do not trust could write.
        """
        path, compression = check_snapshot_args(path, compression, trusted)
        return Dataset(SnapshotNode(self._node, path, compression, trusted))

    def prefetch(self, buffer_size: int) -> Dataset:
        """Compute up to ``buffer_size`` elements ahead on a background thread.

        0 does nothing; ``tp.AUTOTUNE`` lets the runtime choose.
        """
        if buffer_size != AUTOTUNE:
            require_int("prefetch", "buffer_size", buffer_size, minimum=0)
        return Dataset(PrefetchNode(self._node, buffer_size))

    def to_device(self, device: str | torch.device, buffer_size: int = 2) -> Dataset:
        """The same elements with their tensors on ``device``, copied ``buffer_size`` ahead.

        Tensors go through pinned host buffers from a reusable pool and are copied on a side
        CUDA stream; each element is handed over after the consumer's stream waits on its copy.
        ``device="cpu"`` is a no-op.

        Raises:
            RuntimeError: for a CUDA device when CUDA is not available.
        """
        require_int("to_device", "buffer_size", buffer_size, minimum=1)
        return Dataset(DeviceNode(self._node, check_device(device), buffer_size))

    def apply(self, fn: Callable[[Dataset], Dataset]) -> Dataset:
        """``fn(self)``, which must return a Dataset; for reusable chains of ops."""
        require_callable("apply", "fn", fn)
        out = fn(self)
        if not isinstance(out, Dataset):
            raise TypeError(f"apply: fn must return a tp.Dataset, got {type(out).__name__}")
        return out

    def with_options(self, options: Options) -> Dataset:
        """The same pipeline with ``options`` merged over the ones it had."""
        if not isinstance(options, Options):
            raise TypeError(f"with_options: expected tp.Options, got {type(options).__name__}")
        return Dataset(WithOptionsNode(self._node, options))


def _check_dataset(op: str, value: Any) -> None:
    if not isinstance(value, Dataset):
        raise TypeError(f"{op}: expected a tp.Dataset, got {type(value).__name__}")

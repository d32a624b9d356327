"""Device prefetch: batches copied to an accelerator ahead of use, overlapped with compute.

A background thread takes each batch (any nesting of tensors), copies its tensors into pinned
host buffers taken from a reusable pool (no pinned allocation per batch), issues
``non_blocking`` copies to the device on a side CUDA stream and records an event. ``__next__``
makes the consumer's current stream wait on that event and marks every tensor with
``record_stream``, so the caching allocator never hands the memory to another stream too early.
A staging buffer goes back to the pool once its copy's event has completed.

Without CUDA the path degrades cleanly: ``device="cpu"`` is a no-op and nothing is pinned.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections import defaultdict
from typing import Any

import torch

from torchpipe import nest
from torchpipe.core.iterator import Iterator
from torchpipe.core.node import BuildContext, Node
from torchpipe.core.position_log import PositionLog

_WAIT_S = 0.5
_END = object()
# copy threads still running, with their stop events: stopped at interpreter exit (they outlive
# a prefetcher that was dropped mid-epoch by up to one batch)
_LIVE: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = weakref.WeakKeyDictionary()


class PinnedBufferPool:
    """Pinned host buffers, reused once the copy that last read them has completed.

    Buffers are kept by byte size; a tensor is staged in a view of one. Used by one thread.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._busy: list[tuple[Any, torch.Tensor]] = []
        self._pending: list[torch.Tensor] = []  # staged since the last release_after()

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned copy of ``tensor`` (same dtype and shape) in a pooled buffer."""
        nbytes = tensor.numel() * tensor.element_size()
        self._reclaim()
        free = self._free[nbytes]
        buffer = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = (
            buffer.view(tensor.dtype).view(tensor.shape)
            if nbytes
            else torch.empty_like(tensor).pin_memory()
        )
        staged.copy_(tensor)
        self._pending.append(buffer)
        return staged

    def release_after(self, event: Any) -> None:
        """The buffers staged since the last call are free once ``event`` has completed."""
        self._busy.extend((event, buffer) for buffer in self._pending)
        self._pending = []

    def _reclaim(self) -> None:
        still = []
        for event, buffer in self._busy:
            if event.query():
                self._free[buffer.numel()].append(buffer)
            else:
                still.append((event, buffer))
        self._busy = still


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, checked to be usable here.

    Raises:
        RuntimeError: for a CUDA device when CUDA is not available.
        ValueError: for anything but a ``cpu`` or ``cuda`` device (a name or a ``torch.device``),
            and for a CUDA device index this machine does not have.
    """
    if not isinstance(device, (str, torch.device)):
        raise ValueError(
            f"device must be a device name such as 'cuda' or 'cuda:1', or a torch.device; got {device!r}"
        )
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be a cpu or cuda device, got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a cpu or cuda device, got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} was asked for, but CUDA is not available")
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        raise ValueError(
            f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


class DevicePrefetcher:
    """Iterates ``source`` with its batches already on ``device``, up to ``buffer_size`` ahead.

    Args:
        source: an iterator of batches (nested tuples/lists/dicts of tensors and other values).
        device: where batches go; a CPU device makes this a plain pass-through.
        buffer_size: batches copied ahead.
        delivered: batches already delivered before this one started (a resumed epoch).

    Raises:
        RuntimeError: for a CUDA device when CUDA is not available.
    """

    def __init__(
        self, source: Any, device: torch.device | str, buffer_size: int = 2, delivered: int = 0
    ) -> None:
        check_device(device)
        self.delivered = delivered  # batches handed to the consumer (the thread runs ahead)
        self._source = source
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._buffer_size = buffer_size

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __len__(self) -> int:
        return len(self._source)

    def __next__(self) -> Any:
        if not self._cuda:
            batch = next(self._source)
            self.delivered += 1
            return batch
        if self._thread is None:
            self._start()
        thread, items = self._thread, self._queue
        assert thread is not None and items is not None  # started above
        while True:
            try:
                item = items.get(timeout=_WAIT_S)
                break
            except queue.Empty:
                if not thread.is_alive():
                    raise RuntimeError("the device prefetch thread ended unexpectedly") from None
        if item is _END:
            raise StopIteration
        batch, event, error = item
        if error is not None:
            raise error
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for tensor in nest.flatten(batch):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(stream)
        self.delivered += 1
        return batch

    def _start(self) -> None:
        self._queue = queue.Queue(self._buffer_size)
        args = (self._source, self.device, self._queue, self._stop)
        self._thread = threading.Thread(
            target=_copy_ahead, args=args, name="torchpipe-device", daemon=True
        )
        self._thread.start()
        _LIVE[self._thread] = self._stop

    def close(self) -> None:
        """Stop the copy thread; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __del__(self) -> None:
        stop = self.__dict__.get("_stop")
        if stop is not None:
            stop.set()

    def __getattr__(self, name: str) -> Any:
        # state_dict(), stats() and friends of the wrapped iterator stay reachable
        source = self.__dict__.get("_source")
        if source is None:
            raise AttributeError(name)
        return getattr(source, name)


@atexit.register
def _stop_copy_threads() -> None:
    """Copy threads of epochs still open at exit (a loop left with ``break``) stop before the
    interpreter tears CUDA down: a copy still in flight then aborts the process."""
    threads = list(_LIVE.items())
    for _, stop in threads:
        stop.set()
    for thread, _ in threads:
        thread.join(timeout=5)


def _copy_ahead(source: Any, device: torch.device, out: queue.Queue, stop: threading.Event) -> None:
    """The prefetch thread: stage each batch in pinned memory and copy it on a side stream."""
    pool = PinnedBufferPool()
    stream = torch.cuda.Stream(device)
    while not stop.is_set():
        try:
            batch = next(source)
        except StopIteration:
            _put(out, _END, stop)
            return
        except Exception as e:  # noqa: BLE001 - delivered in its place
            _put(out, (None, None, e), stop)
            continue
        with torch.cuda.stream(stream):
            moved = nest.map_structure(lambda x: _to_device(x, device, pool), batch)
            event = torch.cuda.Event()
            event.record(stream)
        pool.release_after(event)
        _put(out, (moved, event, None), stop)


def _to_device(value: Any, device: torch.device, pool: PinnedBufferPool) -> Any:
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return value
    staged = value if value.is_pinned() else pool.stage(value.contiguous())
    return staged.to(device, non_blocking=True)


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            out.put(item, timeout=_WAIT_S)
            return
        except queue.Full:
            continue


class DeviceNode(Node):
    """``to_device``: the input's elements, with their tensors on ``device``."""

    kind = "to_device"
    # the same elements on any device: a checkpoint taken on a GPU resumes on a CPU
    SPEED_PARAMS = ("device", "buffer_size")
    holds_no_elements = True

    def __init__(self, input: Node, device: torch.device, buffer_size: int) -> None:
        super().__init__(input)
        self.device = device
        self.buffer_size = buffer_size

    def params(self) -> dict[str, Any]:
        return {"device": str(self.device), "buffer_size": self.buffer_size}

    def is_asynchronous(self) -> bool:
        return self.device.type != "cpu"

    def build(self, ctx: BuildContext) -> Iterator:
        source = ctx.build_input(self)
        if self.device.type == "cpu":
            return source  # nothing to copy: a no-op
        return DeviceIterator(self.kind, source, self.device, self.buffer_size)


class _Failed:
    """An input error travelling through the copy thread in its element's place."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def numbered(log: PositionLog) -> Any:
    """``(seq, element)`` pairs of the input, pulled (on the copy thread) through ``log``."""
    while True:
        try:
            seq, element, error = log.pull()
        except StopIteration:  # raised inside a generator it would become a RuntimeError
            return
        yield seq, (element if error is None else _Failed(error))


class DeviceIterator(Iterator):
    """Copies elements to the device ahead of use; the checkpoint recomputes copied-ahead ones."""

    def __init__(self, name: str, source: Iterator, device: torch.device, buffer_size: int) -> None:
        super().__init__(name, source)
        self._log = PositionLog(source)
        self._device = device
        self._buffer_size = buffer_size
        self._prefetcher: DevicePrefetcher | None = None

    def start(self) -> None:
        self._prefetcher = DevicePrefetcher(numbered(self._log), self._device, self._buffer_size)

    def next(self) -> Any:
        assert self._prefetcher is not None  # made by start()
        seq, element = next(self._prefetcher)
        self._log.delivered(seq)
        if isinstance(element, _Failed):
            raise element.error
        return element

    def get_state(self) -> dict[str, Any]:
        return self._log.state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._log.set_state(state, self.name)

    def shutdown(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()

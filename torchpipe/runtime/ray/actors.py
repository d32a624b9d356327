"""The Ray actor a stage's calls run on, the actors kept warm between passes, and connecting.

A :class:`TaskServer` actor runs one stage's handler (``handler(seq, payload)``, the same object a
worker process runs) one call at a time, and returns each result encoded as one record
(:mod:`torchpipe.runtime.codec.records`) in a uint8 array, which Ray moves through its object store
without pickling the tensors again: one object per call, so a batch fused with its map travels
as one. The handler reaches the actor once, through the object store, when the actor is
*installed* for a pool (a token names the installation); a call carrying another token (an actor
Ray restarted, which lost its handler) answers :data:`STALE` and the pool installs it again.

Starting an actor costs seconds (a process, torch's import), so a pool that closes leaves its
actors to :data:`IDLE`, from which the next pool with the same options takes them (the next epoch,
the next pass); actors idle for ``IDLE_S`` are killed, freeing their CPUs on the cluster.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from torchpipe.runtime import codec
from torchpipe.runtime.codec.pickling import ALIGN
from torchpipe.runtime.heap import keep_freed_memory
from torchpipe.runtime.processes.worker import pack_exception

_EXTRA = "pip install 'torchpipe[ray]'"
_log = logging.getLogger(__name__)


def require_ray() -> ModuleType:
    """The ``ray`` module.

    Raises:
        ImportError: if Ray is not installed, naming the extra that installs it.
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"executor='ray' and tp.from_ray need Ray: {_EXTRA} (or pip install 'ray[data]')"
        ) from e
    return ray


LOCAL_HOST = "127.0.0.1"
"""Where a Ray cluster that torchpipe starts itself listens: this machine only."""


def connect(address: str | None) -> ModuleType:
    """The ``ray`` module, connected: to the cluster this process is connected to, else to
    ``address``; with None, to ``RAY_ADDRESS`` or a cluster running on this machine, else to a
    new local cluster that torchpipe starts bound to 127.0.0.1 (and says so, with a warning).

    Raises:
        ImportError: if Ray is not installed.
    """
    ray = require_ray()
    if ray.is_initialized():
        return ray
    if address is not None or os.environ.get("RAY_ADDRESS"):
        _log.info("torchpipe: connecting to Ray (address=%r)", address or os.environ["RAY_ADDRESS"])
        ray.init(address=address, ignore_reinit_error=True)
        return ray
    try:
        ray.init(address="auto", ignore_reinit_error=True)  # a cluster started on this machine
    except ConnectionError:
        start_local_cluster(ray)
    return ray


def start_local_cluster(ray: ModuleType) -> None:
    """Start a Ray cluster of this machine alone: its services bound to 127.0.0.1 and no dashboard,
    so that nothing on the network can submit jobs to it (Ray's defaults listen on every address)."""
    warnings.warn(
        f"torchpipe: executor='ray' found no Ray cluster (no address, no RAY_ADDRESS, none running "
        f"here): starting a local one bound to {LOCAL_HOST}, without a dashboard; start one with "
        "`ray start` or pass tp.RayExecutor(address=...) to use another",
        RuntimeWarning,
        stacklevel=3,
    )
    _log.warning("torchpipe: starting a local Ray cluster bound to %s", LOCAL_HOST)
    ray.init(_node_ip_address=LOCAL_HOST, include_dashboard=False, ignore_reinit_error=True)


OK, ERROR, STALE = "ok", "error", "stale"
"""What a call answers: its result's record, its exception packed, or that the actor has another
(or no) handler installed."""
IDLE_S = 5.0
"""Seconds an actor no pool uses is kept warm for the next one before it is killed."""


class TaskServer:
    """Runs in a Ray actor: one stage's handler, one call at a time (Ray's default for an actor)."""

    def __init__(self) -> None:
        self._token: str | None = None
        self._handler: Callable[[int, Any], Any] | None = None

    def install(
        self, token: str, boxed_handler: list[Any], slot: int, threads: int
    ) -> tuple[Any, ...]:
        """Load the handler (``boxed_handler[0]``, an object reference) unless ``token`` is
        installed already, and set the actor up as a worker in ``slot``; ``(OK, pid, node)``
        or ``(ERROR, packed exception)`` if the handler cannot be loaded here (``node``: its
        address and Ray's id)."""
        import ray

        if token != self._token:
            try:
                handler = ray.get(boxed_handler[0])
                # the CPUs the actor reserved; the pool is the parallelism
                torch.set_num_threads(threads)
                keep_freed_memory()
                start = getattr(handler, "start_worker", None)
                if start is not None:
                    start(slot)  # its own global RNG streams where calls do not seed them
            except Exception as e:  # noqa: BLE001 - the pool raises it, naming the actor
                return ERROR, pack_exception(e)
            self._handler, self._token = handler, token
        return (
            OK,
            os.getpid(),
            (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()),
        )

    def run(self, token: str, seq: int, payload: Any) -> tuple[Any, ...]:
        """``(OK, record, wall_s, cpu_s)``, ``(ERROR, packed, wall_s, cpu_s)`` or ``(STALE,)``."""
        if token != self._token:
            return (STALE,)
        wall, cpu = time.perf_counter(), time.thread_time()
        assert self._handler is not None  # installed with the token
        try:
            record = encode_record(self._handler(seq, payload))
        except Exception as e:  # noqa: BLE001 - delivered in the element's place, like a worker's
            return ERROR, pack_exception(e), time.perf_counter() - wall, time.thread_time() - cpu
        return OK, record, time.perf_counter() - wall, time.thread_time() - cpu


def encode_record(element: Any) -> np.ndarray:
    """``element`` as one 64-byte-aligned uint8 record: what the codec writes into a ring, here
    for Ray's object store (which keeps a numpy array's buffer as it is, out of band)."""
    encoded = codec.encode(element)
    raw = np.empty(encoded.nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    record = raw[start : start + encoded.nbytes]
    encoded.write_into(memoryview(record))  # type: ignore[arg-type]  # numpy declares __buffer__ for Python 3.12+ only
    return record


class _ServerClass:
    """``ray.remote(TaskServer)``, made once per process (Ray exports a class once)."""

    _made: Any = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> Any:
        import ray

        with cls._lock:
            if cls._made is None:
                cls._made = ray.remote(TaskServer)
            return cls._made


def start_actor(options: dict[str, Any]) -> Any:
    """A new :class:`TaskServer` actor with Ray ``options`` (resources, restarts, placement)."""
    return _ServerClass.get().options(**options).remote()


def session() -> tuple[str, str]:
    """This process's Ray connection (its job and node): actors of an earlier one are gone."""
    import ray

    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()


class IdleActors:
    """Actors that no pool uses, by the options they were started with, killed after ``IDLE_S``.

    A daemon thread kills the actors that outstay their time while any are kept.
    """

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._idle_s = idle_s
        # Reentrant: a pipeline dropped without close() gives its actors back from a finalizer,
        # which the garbage collector may run on a thread that holds the lock (CI saw one hang).
        self._lock = threading.RLock()
        self._kept: dict[Any, list[tuple[Any, float]]] = {}
        self._reaper: threading.Thread | None = None
        self._wake = threading.Event()

    def take(self, key: Any) -> Any | None:
        """An actor kept for ``key``, or None."""
        with self._lock:
            kept = self._kept.get(key)
            return kept.pop()[0] if kept else None

    def give(self, key: Any, actor: Any) -> None:
        """Keep ``actor`` for the next pool with ``key`` for ``IDLE_S`` seconds."""
        with self._lock:
            self._kept.setdefault(key, []).append((actor, time.monotonic()))
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(
                    target=self._reap, name="torchpipe-ray-idle", daemon=True
                )
                self._reaper.start()

    def clear(self, keep: Any = None) -> None:
        """Kill every kept actor now, but those kept for ``keep``: a pool that must start
        actors of other options frees the resources they hold on the cluster."""
        with self._lock:
            actors = [actor for key, kept in self._kept.items() if key != keep for actor, _ in kept]
            self._kept = {keep: self._kept[keep]} if keep in self._kept else {}
        _kill(actors)

    def count(self) -> int:
        with self._lock:
            return sum(len(kept) for kept in self._kept.values())

    def _reap(self) -> None:
        while True:
            self._wake.wait(self._idle_s / 2)
            now = time.monotonic()
            with self._lock:
                # a finalizer may give more meanwhile (reentrant)
                kept_now = list(self._kept.values())
                old = [
                    actor
                    for kept in kept_now
                    for actor, since in kept
                    if now - since >= self._idle_s
                ]
                for key in list(self._kept):
                    self._kept[key] = [
                        (a, since) for a, since in self._kept[key] if now - since < self._idle_s
                    ]
                    if not self._kept[key]:
                        del self._kept[key]
                done = not self._kept
                if done:
                    self._reaper = None
            _kill(old)
            if done:
                return


def _kill(actors: list[Any]) -> None:
    import ray

    if not ray.is_initialized():
        return  # the connection is gone, and the actors of this job with it
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or the cluster went away: nothing to free
            pass


IDLE = IdleActors()
"""The actors kept warm in this process."""

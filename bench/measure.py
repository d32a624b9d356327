"""One measurement: throughput, time to first batch, the memory the process tree holds at its peak,
its CPU time, how long a loader took to reach its steady rate, and how much of the cores other
processes took meanwhile (the machine may be shared)."""

from __future__ import annotations

import ctypes
import gc
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import psutil

from bench.isolate import tree_root

SAMPLE_S = 0.05
"""How often the monitor's thread reads the tree: RSS and CPU times, and what it holds (issue #57:
at least every 50 ms, so a batch held for a moment shows in the peak)."""
CONVERGE_SPAN_S = 0.5
CONVERGE_WITHIN = 0.1
"""``converge_s``: the end of the first ``CONVERGE_SPAN_S`` window whose rate is within this share
of the row's steady rate."""


class TreeMonitor:
    """Samples the process tree (``bench/isolate.py``'s :func:`tree_root` and all its descendants)
    on a background thread while it is entered: RSS and CPU times, and what the tree holds.

    RSS is summed over the processes, so pages shared between a parent and its forked workers
    count once per process (an upper bound, as ``ps`` would show); :meth:`pss` counts them once,
    and :meth:`held` counts shared memory once whether a process maps it or not. Every
    ``SAMPLE_S`` the thread reads :meth:`pss_and_held` too and keeps their peaks (``peak_pss``,
    ``peak_held``, bytes; ``peak_parts``: what each process held alone at the held peak, and the
    shared memory gained, MB), and the CPU seconds those reads cost it (``sampler_cpu_s``: the kernel
    walks each process's pages, ~3 ms a process with torch loaded), which :meth:`cpu_seconds`
    leaves out of the tree's. CPU time is remembered per process, so a worker that exits before
    the end still counts.
    """

    def __init__(self, root: int | None = None) -> None:
        self._shmem_at_start = system_shmem()
        self._root = psutil.Process(tree_root() if root is None else root)
        self._cpu: dict[tuple[int, float], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.peak_rss = 0
        self.peak_pss: float | None = None
        self.peak_held: float | None = None
        self.start_held: float | None = None  # the tree before the loader: the first reading
        self.peak_parts: dict[str, float] = {}
        self.sampler_cpu_s = 0.0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)

    def __enter__(self) -> TreeMonitor:
        self.sample()
        self.sample_held()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            start = time.thread_time()
            self.sample()
            self.sample_held()
            with self._lock:
                self.sampler_cpu_s += time.thread_time() - start

    def sample_held(self) -> None:
        """Read what the tree holds now (:meth:`pss_and_held`) and update the peaks."""
        pss, held, parts = self._read_held()
        with self._lock:
            self.samples += 1
            if pss is not None:
                self.peak_pss = max(self.peak_pss or 0.0, pss)
            if held is not None:
                if held > (self.peak_held or 0.0):
                    self.peak_parts = parts
                self.peak_held = max(self.peak_held or 0.0, held)
                if self.start_held is None:
                    self.start_held = held

    def sample(self) -> None:
        """Read every process of the tree once; update the peak RSS and the CPU times."""
        try:
            processes = [self._root] + self._root.children(recursive=True)
        except psutil.Error:
            return
        rss = 0
        with self._lock:
            for process in processes:
                try:
                    with process.oneshot():
                        rss += process.memory_info().rss
                        times = process.cpu_times()
                        self._cpu[(process.pid, process.create_time())] = times.user + times.system
                except psutil.Error:
                    continue  # exited between the listing and the read
            self.peak_rss = max(self.peak_rss, rss)

    def pss(self) -> float | None:
        """Proportional set size of the tree now, in bytes: each shared page counts once in all,
        split between the processes that map it (the memory the tree really holds). None where
        ``/proc/<pid>/smaps_rollup`` cannot be read. Costs tens of ms: not sampled while timing."""
        fields = self._rollup(b"Pss:")
        return fields[b"Pss:"] if fields is not None else None

    def held(self) -> float | None:
        """What the tree holds now, in bytes, with shared memory counted once whether a process
        maps it or not: its PSS without the shared-memory pages it maps, plus the growth of the
        machine's shared memory (``Shmem`` in ``/proc/meminfo``) since the monitor started.

        PSS counts no page that no process maps, and a batch torch's DataLoader has sent and not
        yet delivered lies in a shared-memory file that no process maps while it waits; the pages
        are held all the same (and count against a container's memory limit). None where ``/proc``
        cannot be read. Other processes' shared memory made meanwhile counts too: read it beside
        :meth:`pss`, on a machine that is otherwise quiet."""
        return self.pss_and_held()[1]

    def pss_and_held(self) -> tuple[float | None, float | None]:
        """:meth:`pss` and :meth:`held` from one reading of the tree's ``smaps_rollup`` files."""
        return self._read_held()[:2]

    def _read_held(self) -> tuple[float | None, float | None, dict[str, float]]:
        """:meth:`pss_and_held`, and what each process holds alone (PSS without shared memory)
        and the shared memory gained, in MB, keyed ``name:pid`` and ``shmem``."""
        parts: dict[str, float] = {}
        fields = self._rollup(b"Pss:", b"Pss_Shmem:", parts=parts)
        if fields is None:
            return None, None, {}
        shmem = system_shmem()
        if shmem is None or self._shmem_at_start is None:
            return fields[b"Pss:"], None, parts
        gained = max(0, shmem - self._shmem_at_start)
        parts["shmem"] = round(gained / 2**20, 1)
        return fields[b"Pss:"], fields[b"Pss:"] - fields[b"Pss_Shmem:"] + gained, parts

    def _rollup(
        self, *keys: bytes, parts: dict[str, float] | None = None
    ) -> dict[bytes, int] | None:
        """The sums over the tree of these ``smaps_rollup`` fields, in bytes (None where
        unreadable); ``parts`` gets each process's PSS without shared memory, MB."""
        totals = dict.fromkeys(keys, 0)
        wanted = set(keys) | (
            {b"Private_Clean:", b"Private_Dirty:"} if parts is not None else set()
        )
        try:
            processes = [self._root] + self._root.children(recursive=True)
        except psutil.Error:
            return None
        for process in processes:
            found: dict[bytes, int] = {}
            try:
                with open(f"/proc/{process.pid}/smaps_rollup", "rb") as f:
                    for line in f:
                        key, value, *_ = line.split()
                        if key in wanted:
                            found[key] = int(value) * 1024
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited between the listing and the read
            except (OSError, ValueError):
                return None
            if any(key not in found for key in keys):
                return None
            for key in keys:
                totals[key] += found[key]
            if parts is not None and b"Pss_Shmem:" in found:
                alone = found[b"Pss:"] - found[b"Pss_Shmem:"]
                parts[str(process.pid)] = round(alone / 2**20, 1)
                private = found.get(b"Private_Clean:", 0) + found.get(b"Private_Dirty:", 0)
                if private:
                    parts[f"{process.pid} private"] = round(private / 2**20, 1)
        return totals

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by every process seen in the tree (sampled now), but the
        monitor's own reads of what the tree holds."""
        self.sample()
        with self._lock:
            return sum(self._cpu.values()) - self.sampler_cpu_s


def system_shmem() -> int | None:
    """The machine's shared memory now (``Shmem`` in ``/proc/meminfo``: tmpfs and shared anonymous
    pages, mapped or not), in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"Shmem:"))
    except (OSError, StopIteration, ValueError):
        return None


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask)."""
    return (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )


def busy_cpu_seconds(cpus: list[int]) -> float:
    """Seconds the CPUs ``cpus`` have been busy so far, whoever ran there (``/proc/stat``); time a
    hypervisor stole counts as busy: it was not available either."""
    per_cpu = psutil.cpu_times(percpu=True)
    busy = 0.0
    for cpu in cpus:
        if cpu < len(per_cpu):
            t = per_cpu[cpu]
            busy += (
                t.user
                + t.system
                + sum(getattr(t, f, 0.0) for f in ("nice", "irq", "softirq", "steal"))
            )
    return busy


def release_memory() -> None:
    """Collect garbage and return freed heap to the OS, so one measurement's peak RSS does not
    start from the previous one's leftovers."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def close(iterator: Any) -> None:
    """Stop an iterator's workers now (torchpipe iterators and torch's both)."""
    if hasattr(iterator, "close"):
        iterator.close()
    elif hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def measure(
    make: Callable[[], Any],
    count: Callable[[Any], tuple[int, float]],
    warmup_s: float,
    seconds: float,
    min_batches: int = 3,
    whole_epoch: bool = False,
) -> dict[str, Any]:
    """Iterate ``make()`` and measure it.

    The first batch is timed on its own (from ``iter()``: worker start-up included); then
    batches are drawn for ``warmup_s`` seconds so buffers reach their steady state; then for
    ``seconds`` (at least ``min_batches`` batches, or to the end) the throughput in units per
    second (the steady rate) and the process tree's CPU seconds per item are measured. What the
    tree holds is sampled every ``SAMPLE_S`` from before ``make()`` to the end of the window
    (``peak_held_mb``, ``peak_pss_mb``: :class:`TreeMonitor`), and read once more at the end
    (``end_pss_mb``, ``end_held_mb``, for reference). ``converge_s`` is the time from ``iter()``
    to the end of the first ``CONVERGE_SPAN_S`` window whose rate is within ``CONVERGE_WITHIN``
    of the steady rate (:func:`converge_s`; ``converged`` False: none was, and ``converge_s`` is
    the whole run). ``ended_early`` is True where the data ended inside the window (its rate
    then includes the pipeline's drain). ``others_cpu_share`` is the share of the usable cores'
    time that other processes were busy in the window (0: the tree had them to itself).
    ``where`` is where a torchpipe loader or pipeline ran its work at the end (``"process x2"``;
    None for torch's) and ``placement`` what its policy measured (:func:`placement`).

    ``whole_epoch=True`` instead measures everything from ``iter()`` to the end of the data,
    first batch included (batches prefetched while the first one was awaited would otherwise
    look free); its ``converge_s`` is None (there is no steady rate apart from the whole).

    Raises:
        RuntimeError: if the iterable ends before the window (in the first batch or the warm-up).
    """
    release_memory()
    cpus = usable_cpus()
    timeline = Timeline()
    with TreeMonitor() as monitor:
        cpu0, busy0 = monitor.cpu_seconds(), busy_cpu_seconds(cpus)  # read before the clock starts
        timeline.start = time.perf_counter()
        loader = make()
        iterator = iter(loader)
        try:
            if not timeline.draw(iterator, count, 0.0, 1):
                raise RuntimeError("the data ended before its first batch")
            if whole_epoch:
                window = _Window(timeline.start, cpu0, busy0, 0)
            else:
                if not timeline.draw(iterator, count, warmup_s, 0):
                    raise RuntimeError(
                        f"the data ran out in the warm-up, after {timeline.batches} batches (make the "
                        f"data set larger: its rows must outlast warm-up and window)"
                    )
                window = _Window(
                    time.perf_counter(),
                    monitor.cpu_seconds(),
                    busy_cpu_seconds(cpus),
                    timeline.batches,
                )
            ended = not timeline.draw(
                iterator, count, math.inf if whole_epoch else seconds, min_batches
            )
            elapsed = time.perf_counter() - window.start
            cpu, busy = monitor.cpu_seconds() - window.cpu0, busy_cpu_seconds(cpus) - window.busy0
            pss, held = monitor.pss_and_held()
            placed = placement(loader, iterator)
        finally:
            close(iterator)
            del iterator, loader
    items, units = timeline.since(window.batch)
    if items == 0:
        raise RuntimeError(
            "the data ran out before anything was measured (make the data set larger)"
        )
    steady = units / elapsed
    converged = None if whole_epoch else converge_s(timeline.times, timeline.units, steady)
    return {
        "throughput": steady,
        "first_batch_s": timeline.times[0],
        "converge_s": None
        if whole_epoch
        else converged
        if converged is not None
        else timeline.times[-1],
        "converged": converged is not None,
        "ended_early": ended and not whole_epoch,
        **_memory(monitor, pss, held),
        "cpu_s_per_item": max(0.0, cpu)
        / items,  # the sampler's part taken out: ticks can round below 0
        "where": _where(placed),
        "placement": placed,
        # /proc/stat counts in ticks (10 ms): short windows can round past either end.
        "others_cpu_share": min(1.0, max(0.0, busy - cpu) / (elapsed * len(cpus))),
        "sampler_cpu_share": monitor.sampler_cpu_s / (timeline.times[-1] * len(cpus))
        if timeline.times[-1]
        else 0.0,
    }


class _Window(NamedTuple):
    """Where the measured window starts: the clock, the tree's CPU and the cores' busy seconds
    then, and the batches drawn before it."""

    start: float
    cpu0: float
    busy0: float
    batch: int


class Timeline:
    """Every batch drawn from one iterator: its time from ``iter()`` (``start``) and its items and units."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.items: list[int] = []
        self.units: list[float] = []

    @property
    def batches(self) -> int:
        return len(self.times)

    def draw(
        self, iterator: Any, count: Callable[[Any], tuple[int, float]], seconds: float, least: int
    ) -> bool:
        """Draw batches for ``seconds`` and at least ``least`` of them; False where the data ended first."""
        begin, drawn = time.perf_counter(), 0
        while drawn < least or time.perf_counter() - begin < seconds:
            try:
                batch = next(iterator)
            except StopIteration:
                return False
            n, u = count(batch)
            self.times.append(time.perf_counter() - self.start)
            self.items.append(n)
            self.units.append(u)
            drawn += 1
        return True

    def since(self, batch: int) -> tuple[int, float]:
        """Items and units of the batches from ``batch`` on."""
        return sum(self.items[batch:]), sum(self.units[batch:])


def converge_s(
    times: list[float],
    units: list[float],
    steady: float,
    span: float = CONVERGE_SPAN_S,
    within: float = CONVERGE_WITHIN,
) -> float | None:
    """The end of the first window of at least ``span`` seconds whose rate is within ``within`` of
    ``steady``: the time (from ``iter()``, 0) at which a loader first delivered ``span`` at its
    steady rate. ``times[k]`` is when batch ``k`` arrived with ``units[k]``; a window runs from one
    arrival (or ``iter()``) to a later one and counts the units that arrived after its start.
    None where no window is (or ``steady`` is not positive)."""
    if steady <= 0:
        return None
    edges = [0.0, *times]
    done = [0.0]
    for u in units:
        done.append(done[-1] + u)
    end = 0
    for begin in range(len(edges)):
        end = max(end, begin + 1)
        while end < len(edges) and edges[end] - edges[begin] < span:
            end += 1
        if end == len(edges):
            return None
        rate = (done[end] - done[begin]) / (edges[end] - edges[begin])
        if abs(rate / steady - 1.0) <= within:
            return edges[end]
    return None


def _memory(monitor: TreeMonitor, pss: float | None, held: float | None) -> dict[str, float | None]:
    """A measurement's memory in MB: the peaks the monitor sampled (the end reading counted in),
    the end reading, and the summed RSS's peak (for information)."""

    def mb(value: float | None) -> float | None:
        return value / 2**20 if value is not None else None

    peak_pss = max((v for v in (monitor.peak_pss, pss) if v is not None), default=None)
    peak_held = max((v for v in (monitor.peak_held, held) if v is not None), default=None)
    start = monitor.start_held
    return {
        "peak_held_mb": mb(peak_held),
        "start_held_mb": mb(start),
        # what the loader added to the tree at its peak: the memory verdicts' figure (a row's tree
        # before the loader moves with its parent's: peers imported there added ~200 MB)
        "peak_growth_mb": mb(peak_held - start)
        if peak_held is not None and start is not None
        else None,
        "peak_pss_mb": mb(peak_pss),
        "end_pss_mb": mb(pss),
        "end_held_mb": mb(held),
        "peak_rss_mb": monitor.peak_rss / 2**20,
        "peak_parts": monitor.peak_parts,
        "held_samples": monitor.samples,
    }


def _timed(
    iterator: Any, count: Callable[[Any], tuple[int, float]], seconds: float, min_batches: int
) -> tuple[int, float, int]:
    items, units, batches, start = 0, 0.0, 0, time.perf_counter()
    for batch in iterator:
        n, u = count(batch)
        items, units, batches = items + n, units + u, batches + 1
        if batches >= min_batches and time.perf_counter() - start >= seconds:
            break
    return items, units, batches


def measure_epochs(
    make: Callable[[], Any], count: Callable[[Any], tuple[int, float]], epochs: int
) -> dict[str, Any]:
    """Iterate one ``make()`` for ``epochs`` whole epochs and measure each.

    The loader is made once, so persistent workers (and whatever a loader learned) carry over
    from one epoch to the next, as in training. Each epoch is timed from ``iter()`` to its end.
    ``throughput`` is the run's rate, what a user sees: the units of every epoch over their time
    (issue #42); ``steady_throughput`` the epochs' after the first (the first's where there is only
    one); ``epoch_rates`` has every epoch's rate, ``epoch_executors`` where a torchpipe loader ran
    each epoch's work (``loader.stats()``: ``"process x2"``; None for torch's) and ``placement``
    the last epoch's :func:`placement`. ``first_batch_s`` is the first epoch's; CPU per item,
    the peaks (:func:`measure`'s) and the others' share cover every epoch; the end PSS is read
    after the last, before the workers stop.

    Raises:
        RuntimeError: if an epoch yields no batch.
    """
    release_memory()
    cpus = usable_cpus()
    loader = make()
    rates: list[float] = []
    executors: list[str | None] = []
    placed: dict[str, Any] | None = None
    steady = [0.0, 0.0]  # units, seconds of the epochs after the first
    total = [0.0, 0.0]  # units, seconds of every epoch
    items = 0
    with TreeMonitor() as monitor:
        cpu0, busy0 = monitor.cpu_seconds(), busy_cpu_seconds(cpus)
        t_all = time.perf_counter()
        try:
            for epoch in range(epochs):
                t0 = time.perf_counter()
                iterator = iter(loader)
                batch = next(iterator, None)
                if batch is None:
                    raise RuntimeError(f"epoch {epoch} yielded no batch")
                if epoch == 0:
                    first = time.perf_counter() - t0
                n, units = count(batch)
                more = _timed(iterator, count, math.inf, 0)
                elapsed = time.perf_counter() - t0
                items += n + more[0]
                units += more[1]
                rates.append(units / elapsed)
                placed = placement(loader, iterator)
                executors.append(_where(placed))
                total = [total[0] + units, total[1] + elapsed]
                if epoch > 0:
                    steady = [steady[0] + units, steady[1] + elapsed]
                if iterator is not getattr(loader, "_iterator", None):
                    close(iterator)  # a pass of its own (the DSL's): persistent ones stay up
            elapsed_all = time.perf_counter() - t_all
            cpu, busy = monitor.cpu_seconds() - cpu0, busy_cpu_seconds(cpus) - busy0
            pss, held = monitor.pss_and_held()
        finally:
            _close_loader(loader)
    return {
        "throughput": total[0] / total[1],
        "steady_throughput": steady[0] / steady[1] if steady[1] else rates[0],
        "first_batch_s": first,
        **_memory(monitor, pss, held),
        "cpu_s_per_item": max(0.0, cpu)
        / items,  # the sampler's part taken out: ticks can round below 0
        "others_cpu_share": min(1.0, max(0.0, busy - cpu) / (elapsed_all * len(cpus))),
        "sampler_cpu_share": monitor.sampler_cpu_s / (elapsed_all * len(cpus)),
        "epoch_rates": rates,
        "epoch_executors": executors,
        "placement": placed,
    }


def placement(loader: Any, iterator: Any) -> dict[str, Any] | None:
    """Where a torchpipe loader or pipeline ran the pass just ended and what its policy measured,
    from its public ``stats()``; None for torch's and the peers'.

    The stage is the first that reports workers (a pipeline's prefetch runs on a thread of its
    own, the work on the map's), else the first the policy placed (its calls run in this
    process), else the last that reports an executor. ``where`` is
    ``"process x2"`` (``"inline"`` without workers); ``most_processes`` the most worker processes
    a stage the policy placed held at once, over every pass; ``self_s`` the stage's own seconds per element
    (a batch where map and batch are fused); ``measured`` the executors a ``num_workers="auto"``
    DataLoader measured lately; ``knobs`` every stage's AUTOTUNE values at the end; ``autotune``
    the tuner's last round (its values, the throughput it measured and the model's prediction).
    """
    source = loader if hasattr(loader, "stats") else iterator
    if not hasattr(source, "stats"):
        return None
    try:
        stats = source.stats()
        stages = list(stats)
    except Exception:  # noqa: BLE001 - a report only; the measurement stands without it
        return None
    placed = [stage for stage in stages if "executor" in stage]
    auto = next((s for s in placed if "policy" in s), placed[-1] if placed else None)
    stage = next((s for s in placed if s.get("workers")), auto)
    if stage is None:
        return None
    where = (
        f"{stage['executor']} x{stage['workers']}"
        if stage.get("workers")
        else str(stage["executor"])
    )
    knobs = {k: v for s in stages for k, v in s.get("knobs", {}).items()}
    out: dict[str, Any] = {
        "where": where,
        "stage": stage.get("stage"),
        "self_s": stage.get("self_s"),
        "knobs": knobs,
        "bottleneck": getattr(stats, "bottleneck", None),
        "waiting": getattr(stats, "waiting", None),
    }
    for key in ("measured", "not_on_threads", "policy"):
        if key in stage:
            out[key] = stage[key]
    most = [s["most_processes"] for s in placed if "most_processes" in s]
    if most:
        out["most_processes"] = max(most)
    decisions = getattr(stats, "decisions", None) or []
    if decisions:
        last = decisions[-1]
        out["autotune"] = {
            "rounds": len(decisions),
            "values": dict(last.values),
            "throughput": last.throughput,
            "predicted": last.predicted,
        }
    return out


def _where(found: dict[str, Any] | None) -> str | None:
    return None if found is None else found["where"]


def _close_loader(loader: Any) -> None:
    """Stop a loader's persistent workers (torch's keep them in ``loader._iterator``; a peer's
    epochs, ``bench/peer_items.PeerEpochs``, stop what they share on ``close()``)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        close(iterator)
        loader._iterator = None
    stop = getattr(loader, "close", None)
    if callable(stop):
        stop()

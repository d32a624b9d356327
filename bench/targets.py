"""The targets zero-knob torchpipe is held to, checked against one run's results.

Zero-knob torchpipe is what a user gets without tuning anything: the DSL with ``tp.AUTOTUNE``
(``torchpipe_auto``) and the drop-in ``tp.DataLoader(num_workers="auto")``
(``torchpipe_dataloader_auto``). Where a run measured each configuration several times
(``bench/run.py --repeat``), every result is the median of its runs, so every ratio here is a
ratio of medians (issue #42).

On every workload each must reach 0.95 of the best configuration of any loader doing the same
work (``SAME_WORK``: torch's DataLoader grid, torchpipe hand-tuned, torchdata.nodes, SPDL, Grain
and tf.data over the Python item; issue #42) and never fall below ``dataloader_best``, each read
against the run's noise floor (issue #57, :func:`floor`): ``TWINS`` twins of ``dataloader_best``
measured in the same rounds as the zero-knob rows; a row misses either only where it is below
both the bound and the best row's median times the lowest twin's median over the highest (a row
identical to the best reads that far below it on the machine at hand). Each must hold at most
1.1 x the memory torch's DataLoader holds at the same parallelism (issue #41), at their peaks
(issue #57): what the process tree holds (PSS, plus shared memory no process maps: the batches
torch has sent and not yet delivered wait in shared-memory files) sampled every 50 ms through the
row, each row's peak taken on the same tree before the loader (:data:`PEAK`: a row's own tree
before its loader moves with its parent's, by ~200 MB once the peers were imported there), with
as many workers as torchpipe ran its work on at most (``most_processes``, a trial's included:
:func:`most_workers_of`; 0 where it ran in this process, inline or on threads) and
``prefetch_factor=2``. The end PSS and end held ratios are reported beside it, not judged
(summed RSS, which counts pages shared with forked workers once per process, is for information
only). ``converge_s``, the seconds from ``iter()``
to the first 0.5 s at the row's steady rate, must be at most 2 s; the throughput verdicts read
the steady rate, a window long enough that the placement's trials are over.
``tfdata_native``, ``ffcv_best`` and ``torchpipe_tpimage`` do the work with other kernels: they
are references, not held against. The limit column (one core's rate of the item work x the cores)
is reported, not a target.

On ``blobs``, measured epoch by epoch on one loader with persistent workers, what a user sees is
the run (issue #42: the first-epoch target is retired): all epochs together (each row's
``throughput`` there) must reach 0.95 of ``dataloader_best``'s whole run, and every epoch after
the first 0.95 of torch's same epoch (the worst counts); the best of any loader is held there
too, the peers running their epochs as a user would.

Under a RAM budget that binds (``torchpipe_dataloader_budget``, on the workloads with large
batches: halfway from the tree's peak held memory without workers to what ``tp.DataLoader("auto")``
holds at its peak unconstrained), its peak must stay within the budget at 0.95 of the fastest
DataLoader configuration whose peak does.

With ``tp.image``'s ops (``torchpipe_tpimage`` on ``jpeg`` and ``tfrecord``: the same work, zero
knobs; issues #34, #41, #43) torchpipe must keep up with TensorFlow at its own game: at least
``tfdata_native``'s throughput (issue #61: on a full decode both run the same libjpeg-turbo IDCT
on the same cores, so the lead is held on the training transform instead) at no more CPU time
per image, within 1.1x the peak memory of torch's ``dataloader_best``, and, on ``jpeg``, at least
FFCV's best (``ffcv_best``, where FFCV is installed).

On the training-transform workloads (``train_jpeg``, ``train_tfrecord``: RandomResizedCrop, flip,
normalize; issue #61, :func:`train_checks`) ``torchpipe_tpimage`` is held instead to 1.3x
``tfdata_native`` (TensorFlow's decode-and-crop recipe) at no more CPU time an image, 1.3x FFCV's
best where it ran, and at least ``tp.DataLoader("auto")`` over the same work; and
``tp.DataLoader("auto")`` with ``tp.image`` inside torch's dataset to 2x ``dataloader_best`` with
torchvision's transform on Pillow. Each throughput check is read with the floor, which scales a
bound of a multiple (``Target.scaled``: a row at 1.3x reads as low as 1.3 x floor).

Against the peers (``bench/peers.py``), each must reach the best Python peer's best: the fastest
of ``nodes_best``, ``spdl_best``, ``grain_best`` and ``tfdata_best``, which all run the same
Python item function. Its ratio to ``tfdata_native`` (TensorFlow's own ops, where they exist) is
reported, not held to a bound: that pipeline does different work (C++ decode without the GIL).

Beside the checks, :func:`placements` says for each zero-knob row where it ran (each run's
executor and workers) and what its placement policy measured, from the loader's public
``stats()`` (``bench/measure.py``'s ``placement``), so a miss can be read from the report alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ZERO_KNOB = ("torchpipe_auto", "torchpipe_dataloader_auto")
BASELINE = "dataloader_best"
TORCHPIPE_BEST = "torchpipe_best"
PEER_BESTS = ("nodes_best", "spdl_best", "grain_best", "tfdata_best")
"""The peers' bests over the same Python item function (tf.data's through tf.py_function or
tf.numpy_function)."""
SAME_WORK = (
    "dataloader_default",
    BASELINE,
    "torchpipe_dataloader",
    TORCHPIPE_BEST,
    *PEER_BESTS,
    "tfdata_autotune",
)
"""The configurations of every loader doing a workload's own work with its own item function:
``vs_best_of_any`` holds the zero-knob rows to the best of them."""
TFDATA_NATIVE = "tfdata_native"
TWINS = ("dataloader_best_twin1", "dataloader_best_twin2", "dataloader_best_twin3")
"""The rows of ``dataloader_best``'s configuration measured again beside the others: the noise floor."""
FLOORED = ("vs_best_of_any", "vs_dataloader_best", "run_vs_dataloader_best")
"""The checks read against the noise floor (:func:`floor`)."""


@dataclass(frozen=True)
class Target:
    """One check: ``ratio op bound`` (``op`` is ``">="`` or ``"<="``; None: a ratio reported only)."""

    key: str
    label: str
    op: str | None
    bound: float | None
    scaled: bool = False
    """The bound is a multiple of another row's throughput (1.3x, 2x): the floor scales it (a row
    that runs at the bound reads as low as bound x floor) instead of standing in for it."""

    def check(self, ratio: float | None, floor: float | None = None) -> dict[str, Any]:
        """The JSON entry for ``ratio``; ``met`` is None when the ratio could not be computed, or
        is only reported. ``floor`` (a ``">="`` check's noise floor, :func:`floor`'s ratio) is
        kept beside it, and the check is missed only below both the bound and the floor (below
        the bound times the floor where ``scaled``)."""
        out: dict[str, Any] = {"ratio": ratio, "op": self.op, "target": self.bound, "met": None}
        if floor is not None:
            out["floor"] = floor
        if ratio is None or self.op is None or self.bound is None:
            return out
        if self.op == ">=":
            out["met"] = ratio >= self.threshold(floor)
        else:
            out["met"] = ratio <= self.bound
        return out

    def threshold(self, floor: float | None) -> float:
        """The lowest ratio a ``">="`` check passes at, with the run's ``floor`` (None: none)."""
        assert self.bound is not None
        if floor is None:
            return self.bound
        return self.bound * floor if self.scaled else min(self.bound, floor)

    def heading(self) -> str:
        """The printed column heading: the label and the bound."""
        return self.label if self.op is None else f"{self.label} {self.op}{self.bound:g}"


TARGETS = (
    Target("vs_best_of_any", "vs best of any loader", ">=", 0.95),
    Target("vs_dataloader_best", "vs DL best", ">=", 1.0),
    Target("peak_vs_same_workers", "peak held vs DL same workers", "<=", 1.1),
    Target("pss_vs_same_workers", "end PSS vs DL same workers", None, None),
    Target("held_vs_same_workers", "end held (shm once) vs DL same workers", None, None),
    Target("converge_s", "converge s", "<=", 2.0),
    Target("run_vs_dataloader_best", "run vs DL best run", ">=", 0.95),
    Target("later_epochs_vs_dataloader_best", "epochs after 1st vs DL best", ">=", 0.95),
    Target("vs_best_python_peer", "vs best Python peer", ">=", 1.0),
    Target("vs_tfdata_native", "vs tf.data native", None, None),
    Target("peak_vs_budget", "peak held vs budget", "<=", 1.0),
    Target("vs_best_dl_in_budget", "vs best DL in budget", ">=", 0.95),
    Target("image_vs_tfdata_native", "tp.image vs tf.data native", ">=", 1.0),
    Target("image_cpu_vs_tfdata_native", "tp.image CPU/item vs tf.data native", "<=", 1.0),
    Target("image_peak_vs_dataloader_best", "tp.image peak held vs DL best", "<=", 1.1),
    Target("image_pss_vs_dataloader_best", "tp.image end PSS vs DL best", None, None),
    Target("image_held_vs_dataloader_best", "tp.image held (shm once) vs DL best", None, None),
    Target("image_vs_ffcv_best", "tp.image vs FFCV best", ">=", 1.0),
    Target("train_vs_tfdata_native", "train: tp.image vs tf.data native", ">=", 1.3, scaled=True),
    Target("train_cpu_vs_tfdata_native", "train: tp.image CPU/img vs tf.data native", "<=", 1.0),
    Target("train_vs_ffcv_best", "train: tp.image vs FFCV best", ">=", 1.3, scaled=True),
    Target("train_vs_dataloader_auto", "train: DSL vs tp.DataLoader auto", ">=", 1.0, scaled=True),
    Target(
        "train_auto_vs_dataloader_best",
        "train: tp.DataLoader auto vs DL best",
        ">=",
        2.0,
        scaled=True,
    ),
)
BUDGET_CONFIG = "torchpipe_dataloader_budget"
"""``tp.DataLoader("auto")`` under a RAM budget (``bench/run.py``'s ``BUDGETED`` workloads), held to
the last two targets: its peak held memory within the budget, and the throughput of the fastest
DataLoader configuration whose peak fits it."""
BUDGET_KEYS = ("peak_vs_budget", "vs_best_dl_in_budget")
IMAGE_CONFIG = "torchpipe_tpimage"
"""The ``tp.image`` pipeline (``bench/tpimage.py``), held to the ``IMAGE_KEYS`` targets."""
IMAGE_KEYS = (
    "image_vs_tfdata_native",
    "image_cpu_vs_tfdata_native",
    "image_peak_vs_dataloader_best",
    "image_pss_vs_dataloader_best",
    "image_held_vs_dataloader_best",
    "image_vs_ffcv_best",
)
FFCV_BEST = "ffcv_best"
TRAIN_WORKLOADS = ("train_jpeg", "train_tfrecord")
"""The training-transform workloads (``bench/training.py``), held to ``TRAIN_KEYS`` instead of
``IMAGE_KEYS``."""
TRAIN_KEYS = (
    "train_vs_tfdata_native",
    "train_cpu_vs_tfdata_native",
    "train_vs_ffcv_best",
    "train_vs_dataloader_auto",
)
"""``torchpipe_tpimage``'s checks on a training-transform workload."""
TRAIN_AUTO_KEY = "train_auto_vs_dataloader_best"
"""``torchpipe_dataloader_auto``'s added check there: ``tp.image`` inside torch's dataset vs torch's
best DataLoader with torchvision's transform."""
NOISY = 0.15
"""Other processes' share of the cores above which a measurement is flagged as taken beside them."""
EPOCH_WORKLOADS = ("blobs",)
"""Workloads measured epoch by epoch (``epoch_rates``), held to ``EPOCH_KEYS`` instead of
``vs_dataloader_best``."""
EPOCH_KEYS = ("run_vs_dataloader_best", "later_epochs_vs_dataloader_best")


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _worst_epoch(
    mine: dict[str, Any], base: dict[str, Any], first: int = 1
) -> tuple[float | None, int | None]:
    """The lowest ratio of ``mine``'s rate to ``base``'s in the same epoch, from epoch ``first``
    on, and that epoch."""
    pairs = list(zip(mine.get("epoch_rates") or [], base.get("epoch_rates") or []))[first:]
    ratios = [(_ratio(rate, theirs), k) for k, (rate, theirs) in enumerate(pairs, start=first)]
    known = [(r, k) for r, k in ratios if r is not None]
    return min(known) if known else (None, None)


def workers_of(result: dict[str, Any]) -> int | None:
    """The worker processes a torchpipe configuration ran its work on (``where``: ``"process x2"``;
    the last epoch's where epochs are measured): 0 for this process; None where not reported."""
    where = _where(result)
    if where is None:
        return None
    kind, _, count = where.partition(" x")
    return int(count) if kind == "process" and count.isdigit() else 0


def most_workers_of(result: dict[str, Any]) -> int | None:
    """The most worker processes a torchpipe configuration held at once in the run (its
    placement's ``most_processes``: a trial of processes counts), or where it ended
    (:func:`workers_of`) if more or not reported. A zero-knob row's peak memory is judged
    against torch's at this many workers: at its peak the run held what that many of torch's
    workers hold (#58's decision: a run that tried 2 processes and ended on threads is judged
    against torch with 2 workers, its end figures against torch with none)."""
    end = workers_of(result)
    most = (result.get("placement") or {}).get("most_processes")
    if most is None:
        return end
    return max(most, end or 0)


PEAK = "peak_growth_mb"
"""A row's peak, as judged: what its tree held at its peak over what it held before the loader.
Each peak verdict adds the tree before any loader (:func:`tree_before`) to both sides: the tree's
peak as #57 defines it, every row on the same tree (a row's own tree before its loader moves with
its parent's: the peers imported there added ~200 MB to the `jpeg` rows after them, which read
1.5x torch for it)."""


def tree_before(results: dict[str, dict[str, Any]]) -> float:
    """The tree before any loader (MB): ``dataloader_default``'s first reading, 0 if not read."""
    return results.get("dataloader_default", {}).get("start_held_mb") or 0.0


def _held(growth: float | None, before: float) -> float | None:
    return None if growth is None else growth + before


def floor(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The run's noise floor on one workload, from its ``TWINS`` (each the median of its runs):
    ``ratio``, the lowest twin's median over the highest's, and the twins' medians. A row whose
    throughput is at least the best row's median times ``ratio`` cannot be told from that best row
    on this machine today, so a ``FLOORED`` check misses only below it. None with fewer than two
    twins measured."""
    medians = {name: results[name]["throughput"] for name in TWINS if name in results}
    if len(medians) < 2 or max(medians.values()) <= 0:
        return None
    return {"ratio": min(medians.values()) / max(medians.values()), "twins": medians}


def targets(
    name: str,
    results: dict[str, dict[str, Any]],
    dataloader_memory: dict[str, dict[int, float | None]] | None = None,
    budget: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each zero-knob configuration's ratios against its targets, as ``{config: {key: check}}``.

    ``dataloader_memory`` is torch's DataLoader's memory by ``num_workers`` (``prefetch_factor=2``)
    for each memory key of a result (``peak_growth_mb``, ``end_pss_mb``, ``end_held_mb``). A ratio
    is None (and ``met`` None) where what it needs was not measured: the configuration itself,
    ``dataloader_best``, a memory figure (None where ``/proc`` could not be read), or the
    DataLoader at the configuration's worker count. ``FLOORED`` checks carry the run's noise floor
    (``floor``: :func:`floor`'s ratio, where twins were measured). ``vs_best_of_any`` and
    ``vs_best_python_peer`` name the configuration they compare with (``against``);
    ``later_epochs_vs_dataloader_best`` the epoch its ratio was lowest in (``epoch``, 0 the
    first); the memory checks the worker count (``workers``). ``budget`` (``growth_mb``: the
    budget as what the loader adds to the tree at its peak; ``best_throughput``: the fastest
    DataLoader configuration within it) checks :data:`BUDGET_CONFIG` where it was measured.
    """
    epochs = name in EPOCH_WORKLOADS
    skipped = BUDGET_KEYS + IMAGE_KEYS + TRAIN_KEYS + (TRAIN_AUTO_KEY,)
    skipped += ("vs_dataloader_best",) if epochs else EPOCH_KEYS
    wanted = [t for t in TARGETS if t.key not in skipped]
    noise = floor(results)
    memory_at = {key: (dataloader_memory or {}).get(key) or {} for key in _MEMORY.values()}
    out = {
        config: _zero_knob_checks(config, results, memory_at, wanted, noise) for config in ZERO_KNOB
    }
    if budget is not None and BUDGET_CONFIG in results:
        mine, by_key = results[BUDGET_CONFIG], {t.key: t for t in TARGETS}
        before = tree_before(results)
        out[BUDGET_CONFIG] = {
            "peak_vs_budget": by_key["peak_vs_budget"].check(
                _ratio(_held(mine.get(PEAK), before), _held(budget["growth_mb"], before))
            ),
            "vs_best_dl_in_budget": by_key["vs_best_dl_in_budget"].check(
                _ratio(mine["throughput"], budget["best_throughput"])
            ),
        }
    if name in TRAIN_WORKLOADS:
        for config, checks in train_checks(results, noise).items():
            out.setdefault(config, {}).update(checks)
    elif IMAGE_CONFIG in results:
        out[IMAGE_CONFIG] = _image_checks(name, results)
    return out


_MEMORY = {
    "peak_vs_same_workers": PEAK,
    "pss_vs_same_workers": "end_pss_mb",
    "held_vs_same_workers": "end_held_mb",
}
"""Each memory check and the figure of a result it compares with torch's at the same workers."""


def _fastest(results: dict[str, dict[str, Any]], configs: tuple[str, ...]) -> str | None:
    return max(
        (c for c in configs if c in results), key=lambda c: results[c]["throughput"], default=None
    )


def _zero_knob_checks(
    config: str,
    results: dict[str, dict[str, Any]],
    memory_at: dict[str, dict[int, float | None]],
    wanted: list[Target],
    noise: dict[str, Any] | None,
) -> dict[str, dict[str, Any]]:
    """``config``'s checks against the ``wanted`` targets (see :func:`targets`); ``memory_at``
    holds torch's figures by worker count for each memory key of a result; ``noise`` the floor."""
    mine, base = results.get(config, {}), results.get(BASELINE, {})
    throughput = mine.get("throughput")
    best, peer = _fastest(results, SAME_WORK), _fastest(results, PEER_BESTS)
    worst, epoch = _worst_epoch(mine, base)
    workers = workers_of(mine)
    ratios = {
        "vs_best_of_any": _ratio(throughput, results[best]["throughput"] if best else None),
        "vs_dataloader_best": _ratio(throughput, base.get("throughput")),
        "run_vs_dataloader_best": _ratio(throughput, base.get("throughput")),
        "later_epochs_vs_dataloader_best": worst,
        "vs_best_python_peer": _ratio(throughput, results[peer]["throughput"] if peer else None),
        "vs_tfdata_native": _ratio(throughput, results.get(TFDATA_NATIVE, {}).get("throughput")),
        "converge_s": mine.get("converge_s"),
    }
    at = dict.fromkeys(_MEMORY, workers) | {"peak_vs_same_workers": most_workers_of(mine)}
    before = tree_before(results)
    for key, figure in _MEMORY.items():
        theirs = memory_at[figure].get(at[key]) if at[key] is not None else None
        if figure == PEAK:
            ratios[key] = _ratio(_held(mine.get(figure), before), _held(theirs, before))
        else:
            ratios[key] = _ratio(mine.get(figure), theirs)
    floor_ratio = noise["ratio"] if noise is not None else None
    out = {t.key: t.check(ratios[t.key], floor_ratio if t.key in FLOORED else None) for t in wanted}
    out["vs_best_of_any"]["against"] = best
    out["vs_best_python_peer"]["against"] = peer
    for key in _MEMORY:
        out[key]["workers"] = at[key]
    if "later_epochs_vs_dataloader_best" in out:
        out["later_epochs_vs_dataloader_best"]["epoch"] = epoch
    return out


def placements(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each zero-knob configuration measured: where each run ran (``runs``: ``"process x2"``,
    the last epoch's on an epochs workload; ``epochs``: each epoch's, of the median run) and what
    its policy measured in the median run (``policy``: ``bench/measure.py``'s ``placement``)."""
    out = {}
    for config in ZERO_KNOB:
        if config not in results:
            continue
        mine = results[config]
        runs = mine.get("runs") or [mine]
        out[config] = {
            "runs": [_where(run) for run in runs],
            "epochs": mine.get("epoch_executors"),
            "policy": mine.get("placement"),
        }
    return out


def _where(result: dict[str, Any]) -> str | None:
    return result.get("where") or (result.get("epoch_executors") or [None])[-1]


def _image_checks(name: str, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``torchpipe_tpimage``'s checks: against tf.data's native pipeline (throughput, CPU per
    item), torch's best DataLoader (peak held memory; end PSS and end held reported) and, on
    ``jpeg``, FFCV's best."""
    mine, native = results[IMAGE_CONFIG], results.get(TFDATA_NATIVE, {})
    by_key = {t.key: t for t in TARGETS}
    ratios = {
        "image_vs_tfdata_native": _ratio(mine["throughput"], native.get("throughput")),
        "image_cpu_vs_tfdata_native": _ratio(
            mine.get("cpu_s_per_item"), native.get("cpu_s_per_item")
        ),
        "image_peak_vs_dataloader_best": _ratio(
            _held(mine.get(PEAK), tree_before(results)),
            _held(results.get(BASELINE, {}).get(PEAK), tree_before(results)),
        ),
        "image_pss_vs_dataloader_best": _ratio(
            mine.get("end_pss_mb"), results.get(BASELINE, {}).get("end_pss_mb")
        ),
        "image_held_vs_dataloader_best": _ratio(
            mine.get("end_held_mb"), results.get(BASELINE, {}).get("end_held_mb")
        ),
        "image_vs_ffcv_best": _ratio(
            mine["throughput"], results.get(FFCV_BEST, {}).get("throughput")
        ),
    }
    keys = [k for k in IMAGE_KEYS if k != "image_vs_ffcv_best" or name == "jpeg"]
    return {key: by_key[key].check(ratios[key]) for key in keys}


def train_checks(
    results: dict[str, dict[str, Any]], noise: dict[str, Any] | None
) -> dict[str, dict[str, dict[str, Any]]]:
    """The training-transform targets (issue #61), throughput read with the floor ``noise``:
    ``torchpipe_tpimage`` at least 1.3x ``tfdata_native`` at no more CPU an image, 1.3x FFCV's
    best where it ran, and at least ``tp.DataLoader("auto")`` doing the same work;
    ``torchpipe_dataloader_auto`` (``tp.image`` inside torch's dataset) 2x ``dataloader_best``
    (torchvision's transform on Pillow). A check whose rows were not measured has ``met`` None."""
    by_key, floor_ratio = {t.key: t for t in TARGETS}, noise["ratio"] if noise is not None else None
    mine, auto = results.get(IMAGE_CONFIG, {}), results.get("torchpipe_dataloader_auto", {})
    native = results.get(TFDATA_NATIVE, {})
    ratios = {
        "train_vs_tfdata_native": _ratio(mine.get("throughput"), native.get("throughput")),
        "train_cpu_vs_tfdata_native": _ratio(
            mine.get("cpu_s_per_item"), native.get("cpu_s_per_item")
        ),
        "train_vs_ffcv_best": _ratio(
            mine.get("throughput"), results.get(FFCV_BEST, {}).get("throughput")
        ),
        "train_vs_dataloader_auto": _ratio(mine.get("throughput"), auto.get("throughput")),
        TRAIN_AUTO_KEY: _ratio(auto.get("throughput"), results.get(BASELINE, {}).get("throughput")),
    }

    def check(key: str) -> dict[str, Any]:
        target = by_key[key]
        return target.check(ratios[key], floor_ratio if target.op == ">=" else None)

    out: dict[str, dict[str, dict[str, Any]]] = {}
    if IMAGE_CONFIG in results:
        out[IMAGE_CONFIG] = {key: check(key) for key in TRAIN_KEYS}
    if auto:
        out["torchpipe_dataloader_auto"] = {TRAIN_AUTO_KEY: check(TRAIN_AUTO_KEY)}
    return out


def _cell(check: dict[str, Any] | None) -> str:
    if check is None:
        return ""
    if check["ratio"] is not None and check["op"] is None:
        return f"{check['ratio']:.2f}"  # reported, not held to a bound
    if check["met"] is None:
        return "-"
    floor = f" (floor {check['floor']:.2f})" if check.get("floor") is not None else ""
    return f"{check['ratio']:.2f} {'ok' if check['met'] else 'MISS'}{floor}"


def reported(report: dict[str, Any]) -> list[Target]:
    """The targets some row of ``report`` was checked against, in ``TARGETS``' order: a table's
    columns (a run of the default workloads has no training-transform checks, and the reverse)."""
    checked = [
        checks
        for entry in report["workloads"].values()
        for checks in entry.get("targets", {}).values()
    ]
    keys = {key for checks in checked for key in checks}
    return [t for t in TARGETS if t.key in keys]


def format_targets(report: dict[str, Any]) -> str:
    """The printed check: one row per workload and zero-knob configuration, and a count of misses."""
    shown = reported(report)
    headings = [t.heading() for t in shown]
    lines = [
        "targets of zero-knob torchpipe (ok: met, MISS: not met, -: not measured; a check with a floor "
        "misses only below it too)",
        f"{'workload':<10} {'config':<25} " + " ".join(f"{h:>22}" for h in headings),
    ]
    met = missed = 0
    misses = []
    for name, entry in report["workloads"].items():
        for config, checks in entry.get("targets", {}).items():
            cells = [_cell(checks.get(t.key)) for t in shown]
            lines.append(f"{name:<10} {config:<25} " + " ".join(f"{c:>22}" for c in cells))
            for key, check in checks.items():
                met += check["met"] is True
                if check["met"] is False:
                    missed += 1
                    misses.append(f"{name}/{config} {key}")
    lines.append(
        f"{met} targets met, {missed} missed" + (f": {', '.join(misses)}" if misses else "")
    )
    ran = [
        f"  {name}/{config}: {describe(found)}"
        for name, entry in report["workloads"].items()
        for config, found in entry.get("placement", {}).items()
    ]
    if ran:
        lines += ["where the zero-knob rows ran, and what their policy measured:", *ran]
    noisy = _noisy(report)
    if noisy:
        lines.append(
            f"measured while other processes took {NOISY:.0%} or more of the cores: {', '.join(noisy)}"
        )
    return "\n".join(lines)


def describe(found: dict[str, Any]) -> str:
    """One zero-knob row's :func:`placements` entry in words: where its median run ran (and each
    run, where there were several), then what its policy measured: ``ran on process x2 (runs in
    order: process x2, inline, process x2); map(f)+batch: 0.62 ms of its own an element; ...``."""
    runs, policy = found.get("runs") or [], found.get("policy") or {}
    parts = [f"ran on {_where_words(policy.get('where'))}"]
    if len(runs) > 1:
        parts[0] += f" (runs in order: {', '.join(_where_words(r) for r in runs)})"
    if found.get("epochs"):
        parts.append(f"epochs: {', '.join(_where_words(e) for e in found['epochs'])}")
    if policy.get("self_s") is not None:
        parts.append(
            f"{policy.get('stage')}: {policy['self_s'] * 1e3:.3g} ms of its own an element"
        )
    if "measured" in policy:
        parts.append(f"executors measured: {', '.join(policy['measured']) or 'none yet'}")
    measured = policy.get("policy") or {}
    if measured.get("costs"):
        c = measured["costs"]
        parts.append(
            f"a call {c['call_s'] * 1e3:.3g} ms ({c['cpu_s'] * 1e3:.3g} CPU, {c['gil_free']:.0%} GIL-free), "
            f"{c['nbytes'] / 1e3:.4g} kB to move at {c['move_s'] * 1e3:.3g} ms"
        )
    if measured.get("measured_s"):
        parts.append(
            "per element "
            + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in measured["measured_s"].items())
        )
    if policy.get("not_on_threads"):
        parts.append(f"not on threads: {policy['not_on_threads']}")
    if policy.get("knobs"):
        parts.append("knobs " + ", ".join(f"{k}={v}" for k, v in policy["knobs"].items()))
    tuned = policy.get("autotune")
    if tuned:
        parts.append(
            f"autotune {tuned['rounds']} rounds, measured {tuned['throughput']:.4g}/s, "
            f"model {tuned['predicted']:.4g}/s"
        )
    if policy.get("bottleneck"):
        parts.append(
            f"bottleneck {policy['bottleneck']}, loop waited {policy.get('waiting') or 0:.0%}"
        )
    return "; ".join(parts)


def _where_words(where: str | None) -> str:
    return where or "not reported"


def _noisy(report: dict[str, Any]) -> list[str]:
    """``workload/config (share)`` for each configuration the targets use that ran beside other work."""
    out = []
    for name, entry in report["workloads"].items():
        for config in (BASELINE, TORCHPIPE_BEST, *ZERO_KNOB, *PEER_BESTS, TFDATA_NATIVE):
            share = entry.get("results", {}).get(config, {}).get("others_cpu_share")
            if share is not None and share >= NOISY:
                out.append(f"{name}/{config} ({share:.0%})")
    return out

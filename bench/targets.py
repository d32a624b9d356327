"""The targets zero-knob torchpipe is held to, checked against one run's results.

Zero-knob torchpipe is what a user gets without tuning anything: the DSL with ``tp.AUTOTUNE``
(``torchpipe_auto``) and the drop-in ``tp.DataLoader(num_workers="auto")``
(``torchpipe_dataloader_auto``). On every workload each must reach 0.95 of the faster of the two
hand-tuned bests (torch's ``dataloader_best`` and ``torchpipe_best``), never fall below
``dataloader_best``, and hold at most 1.2 x the memory torch's DataLoader holds at the same
parallelism (issue #33): with as many workers as torchpipe ran its work on (``process xN``; 0 where
it ran in this process, inline or on threads) and ``prefetch_factor=2``, compared as the process
tree's PSS at the end of the timed window (each shared page counted once: summed RSS counts pages
shared with forked workers once per process, so it stays in the table for information only). The
limit column (one core's rate of the item work x the cores) is reported, not a target: the
zero-knob rule above is the target everywhere. On ``blobs``, measured epoch by epoch
on one loader with persistent workers, each must reach 0.95 of ``dataloader_best`` in every
epoch from the first on (issue #33): epoch k against torch's epoch k, the worst epoch counts.
Under a RAM budget that binds (``torchpipe_dataloader_budget``, on the workloads with large
batches: halfway from the tree's PSS without workers to what ``tp.DataLoader("auto")`` holds
unconstrained), it must end within the budget (as the tree's PSS) at 0.95 of the fastest
DataLoader configuration that ends within it.

With ``tp.image``'s ops (``torchpipe_tpimage`` on ``jpeg`` and ``tfrecord``: the same work, zero
knobs; issue #34) torchpipe must beat TensorFlow at its own game: 1.1x ``tfdata_native``'s
throughput at no more CPU time per image, within the memory of torch's ``dataloader_best``, and,
on ``jpeg``, at least FFCV's best (``ffcv_best``, where FFCV is installed).

Against the peers (``bench/peers.py``), each must reach the best Python peer's best: the fastest
of ``nodes_best``, ``spdl_best``, ``grain_best`` and ``tfdata_best``, which all run the same
Python item function. Its ratio to ``tfdata_native`` (TensorFlow's own ops, where they exist) is
reported, not held to a bound: that pipeline does different work (C++ decode without the GIL).
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
TFDATA_NATIVE = "tfdata_native"


@dataclass(frozen=True)
class Target:
    """One check: ``ratio op bound`` (``op`` is ``">="`` or ``"<="``; None: a ratio reported only)."""

    key: str
    label: str
    op: str | None
    bound: float | None

    def check(self, ratio: float | None) -> dict[str, Any]:
        """The JSON entry for ``ratio``; ``met`` is None when the ratio could not be computed, or
        is only reported."""
        if ratio is None or self.op is None or self.bound is None:
            return {"ratio": ratio, "op": self.op, "target": self.bound, "met": None}
        met = ratio >= self.bound if self.op == ">=" else ratio <= self.bound
        return {"ratio": ratio, "op": self.op, "target": self.bound, "met": met}

    def heading(self) -> str:
        """The printed column heading: the label and the bound."""
        return self.label if self.op is None else f"{self.label} {self.op}{self.bound:g}"


TARGETS = (
    Target("vs_best_of_both", "vs max(DL,TP best)", ">=", 0.95),
    Target("vs_dataloader_best", "vs DL best", ">=", 1.0),
    Target("pss_vs_same_workers", "PSS vs DL same workers", "<=", 1.2),
    Target("every_epoch_vs_dataloader_best", "every epoch vs DL best", ">=", 0.95),
    Target("vs_best_python_peer", "vs best Python peer", ">=", 1.0),
    Target("vs_tfdata_native", "vs tf.data native", None, None),
    Target("pss_vs_budget", "PSS vs budget", "<=", 1.0),
    Target("vs_best_dl_in_budget", "vs best DL in budget", ">=", 0.95),
    Target("image_vs_tfdata_native", "tp.image vs tf.data native", ">=", 1.1),
    Target("image_cpu_vs_tfdata_native", "tp.image CPU/item vs tf.data native", "<=", 1.0),
    Target("image_pss_vs_dataloader_best", "tp.image PSS vs DL best", "<=", 1.0),
    Target("image_vs_ffcv_best", "tp.image vs FFCV best", ">=", 1.0),
)
BUDGET_CONFIG = "torchpipe_dataloader_budget"
"""``tp.DataLoader("auto")`` under a RAM budget (``bench/run.py``'s ``BUDGETED`` workloads), held to
the last two targets: end PSS within the budget, and the throughput of the fastest DataLoader
configuration whose end PSS fits it."""
BUDGET_KEYS = ("pss_vs_budget", "vs_best_dl_in_budget")
IMAGE_CONFIG = "torchpipe_tpimage"
"""The ``tp.image`` pipeline (``bench/tpimage.py``), held to the ``IMAGE_KEYS`` targets."""
IMAGE_KEYS = ("image_vs_tfdata_native", "image_cpu_vs_tfdata_native", "image_pss_vs_dataloader_best",
              "image_vs_ffcv_best")  # fmt: skip
FFCV_BEST = "ffcv_best"
NOISY = 0.15
"""Other processes' share of the cores above which a measurement is flagged as taken beside them."""
EPOCH_WORKLOADS = ("blobs",)
"""Workloads held to ``every_epoch_vs_dataloader_best``: measured epoch by epoch (``epoch_rates``)."""


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _worst_epoch(mine: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, int | None]:
    """The lowest ratio of ``mine``'s rate to ``base``'s in the same epoch, and that epoch."""
    pairs = list(zip(mine.get("epoch_rates") or [], base.get("epoch_rates") or []))
    ratios = [(_ratio(rate, theirs), k) for k, (rate, theirs) in enumerate(pairs)]
    known = [(r, k) for r, k in ratios if r is not None]
    return min(known) if known else (None, None)


def workers_of(result: dict[str, Any]) -> int | None:
    """The worker processes a torchpipe configuration ran its work on (``where``: ``"process x2"``;
    the last epoch's where epochs are measured): 0 for this process; None where not reported."""
    where = result.get("where") or (result.get("epoch_executors") or [None])[-1]
    if where is None:
        return None
    kind, _, count = where.partition(" x")
    return int(count) if kind == "process" and count.isdigit() else 0


def targets(
    name: str,
    results: dict[str, dict[str, Any]],
    dataloader_pss: dict[int, float | None] | None = None,
    budget: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each zero-knob configuration's ratios against its targets, as ``{config: {key: check}}``.

    ``dataloader_pss`` is torch's DataLoader's end PSS by ``num_workers`` (``prefetch_factor=2``).
    A ratio is None (and ``met`` None) where what it needs was not measured: the configuration
    itself, ``dataloader_best``, a PSS (None where ``/proc`` could not be read), or the DataLoader
    at the configuration's worker count. Where only one of ``dataloader_best`` and
    ``torchpipe_best`` was measured, ``vs_best_of_both`` compares with it. ``vs_best_python_peer``
    names the peer it compares with (``against``); ``every_epoch_vs_dataloader_best`` the epoch its
    ratio was lowest in (``epoch``); ``pss_vs_same_workers`` the worker count (``workers``).
    ``budget`` (``pss_mb``: the budget as the tree's end PSS; ``best_throughput``: the fastest
    DataLoader configuration within it) checks :data:`BUDGET_CONFIG` where it was measured.
    """
    base = results.get(BASELINE, {})
    bests = [results[c]["throughput"] for c in (BASELINE, TORCHPIPE_BEST) if c in results]
    peer = max((c for c in PEER_BESTS if c in results), key=lambda c: results[c]["throughput"], default=None)
    native = results.get(TFDATA_NATIVE, {}).get("throughput")
    only = {"every_epoch_vs_dataloader_best": EPOCH_WORKLOADS}
    pss_at = dataloader_pss or {}
    wanted = [t for t in TARGETS if name in only.get(t.key, (name,)) and t.key not in BUDGET_KEYS + IMAGE_KEYS]
    out = {}
    for config in ZERO_KNOB:
        mine = results.get(config, {})
        throughput = mine.get("throughput")
        worst, epoch = _worst_epoch(mine, base)
        workers = workers_of(mine)
        ratios = {
            "every_epoch_vs_dataloader_best": worst,
            "vs_best_of_both": _ratio(throughput, max(bests, default=None)),
            "vs_dataloader_best": _ratio(throughput, base.get("throughput")),
            "pss_vs_same_workers": _ratio(mine.get("end_pss_mb"), pss_at.get(workers) if workers is not None else None),
            "vs_best_python_peer": _ratio(throughput, results[peer]["throughput"] if peer else None),
            "vs_tfdata_native": _ratio(throughput, native),
        }
        out[config] = {t.key: t.check(ratios[t.key]) for t in wanted}
        out[config]["vs_best_python_peer"]["against"] = peer
        out[config]["pss_vs_same_workers"]["workers"] = workers
        if "every_epoch_vs_dataloader_best" in out[config]:
            out[config]["every_epoch_vs_dataloader_best"]["epoch"] = epoch
    if budget is not None and BUDGET_CONFIG in results:
        mine, by_key = results[BUDGET_CONFIG], {t.key: t for t in TARGETS}
        out[BUDGET_CONFIG] = {
            "pss_vs_budget": by_key["pss_vs_budget"].check(_ratio(mine.get("end_pss_mb"), budget["pss_mb"])),
            "vs_best_dl_in_budget": by_key["vs_best_dl_in_budget"].check(
                _ratio(mine["throughput"], budget["best_throughput"])
            ),
        }
    if IMAGE_CONFIG in results:
        out[IMAGE_CONFIG] = _image_checks(name, results)
    return out


def _image_checks(name: str, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``torchpipe_tpimage``'s checks: against tf.data's native pipeline (throughput, CPU per
    item), torch's best DataLoader (end PSS) and, on ``jpeg``, FFCV's best."""
    mine, native = results[IMAGE_CONFIG], results.get(TFDATA_NATIVE, {})
    by_key = {t.key: t for t in TARGETS}
    ratios = {
        "image_vs_tfdata_native": _ratio(mine["throughput"], native.get("throughput")),
        "image_cpu_vs_tfdata_native": _ratio(mine.get("cpu_s_per_item"), native.get("cpu_s_per_item")),
        "image_pss_vs_dataloader_best": _ratio(mine.get("end_pss_mb"), results.get(BASELINE, {}).get("end_pss_mb")),
        "image_vs_ffcv_best": _ratio(mine["throughput"], results.get(FFCV_BEST, {}).get("throughput")),
    }
    keys = [k for k in IMAGE_KEYS if k != "image_vs_ffcv_best" or name == "jpeg"]
    return {key: by_key[key].check(ratios[key]) for key in keys}


def _cell(check: dict[str, Any] | None) -> str:
    if check is None:
        return ""
    if check["ratio"] is not None and check["op"] is None:
        return f"{check['ratio']:.2f}"  # reported, not held to a bound
    if check["met"] is None:
        return "-"
    return f"{check['ratio']:.2f} {'ok' if check['met'] else 'MISS'}"


def format_targets(report: dict[str, Any]) -> str:
    """The printed check: one row per workload and zero-knob configuration, and a count of misses."""
    headings = [t.heading() for t in TARGETS]
    lines = ["targets of zero-knob torchpipe (ok: met, MISS: not met, -: not measured)",
             f"{'workload':<10} {'config':<25} " + " ".join(f"{h:>22}" for h in headings)]  # fmt: skip
    met = missed = 0
    misses = []
    for name, entry in report["workloads"].items():
        for config, checks in entry.get("targets", {}).items():
            cells = [_cell(checks.get(t.key)) for t in TARGETS]
            lines.append(f"{name:<10} {config:<25} " + " ".join(f"{c:>22}" for c in cells))
            for key, check in checks.items():
                met += check["met"] is True
                if check["met"] is False:
                    missed += 1
                    misses.append(f"{name}/{config} {key}")
    lines.append(f"{met} targets met, {missed} missed" + (f": {', '.join(misses)}" if misses else ""))
    noisy = _noisy(report)
    if noisy:
        lines.append(f"measured while other processes took {NOISY:.0%} or more of the cores: {', '.join(noisy)}")
    return "\n".join(lines)


def _noisy(report: dict[str, Any]) -> list[str]:
    """``workload/config (share)`` for each configuration the targets use that ran beside other work."""
    out = []
    for name, entry in report["workloads"].items():
        for config in (BASELINE, TORCHPIPE_BEST, *ZERO_KNOB, *PEER_BESTS, TFDATA_NATIVE):
            share = entry.get("results", {}).get(config, {}).get("others_cpu_share")
            if share is not None and share >= NOISY:
                out.append(f"{name}/{config} ({share:.0%})")
    return out

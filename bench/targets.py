"""The targets zero-knob torchpipe is held to, checked against one run's results.

Zero-knob torchpipe is what a user gets without tuning anything: the DSL with ``tp.AUTOTUNE``
(``torchpipe_auto``) and the drop-in ``tp.DataLoader(num_workers="auto")``
(``torchpipe_dataloader_auto``). On every workload each must reach 0.95 of the faster of the two
hand-tuned bests (torch's ``dataloader_best`` and ``torchpipe_best``), never fall below
``dataloader_best``, and hold at most 1.2 x the memory ``dataloader_best`` holds, compared as
the process tree's PSS at the end of the timed window (each shared page counted once: summed RSS
counts pages shared with forked workers once per process, so it stays in the table for
information only). On ``tiny``, whose item function caps any loader, each must also reach 0.9 of
the limit (one core's rate of the item work x the cores). On ``blobs``, measured epoch by epoch
on one loader with persistent workers, each must reach 0.95 of ``dataloader_best`` in every
epoch from the first on (issue #33): epoch k against torch's epoch k, the worst epoch counts.

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
    Target("pss_vs_dataloader_best", "PSS vs DL best", "<=", 1.2),
    Target("vs_limit", "vs limit", ">=", 0.9),
    Target("every_epoch_vs_dataloader_best", "every epoch vs DL best", ">=", 0.95),
    Target("vs_best_python_peer", "vs best Python peer", ">=", 1.0),
    Target("vs_tfdata_native", "vs tf.data native", None, None),
)
NOISY = 0.15
"""Other processes' share of the cores above which a measurement is flagged as taken beside them."""
LIMIT_WORKLOADS = ("tiny",)
"""Workloads held to ``vs_limit``: where the item function itself is the limit of any loader."""
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


def targets(name: str, results: dict[str, dict[str, Any]], limit: float | None) -> dict[str, dict[str, Any]]:
    """Each zero-knob configuration's ratios against its targets, as ``{config: {key: check}}``.

    A ratio is None (and ``met`` None) where what it needs was not measured: the configuration
    itself, ``dataloader_best``, or a PSS (None where ``/proc`` could not be read). Where only one
    of ``dataloader_best`` and ``torchpipe_best`` was measured, ``vs_best_of_both`` compares with it.
    ``vs_best_python_peer`` names the peer it compares with (``against``);
    ``every_epoch_vs_dataloader_best`` the epoch its ratio was lowest in (``epoch``).
    """
    base = results.get(BASELINE, {})
    bests = [results[c]["throughput"] for c in (BASELINE, TORCHPIPE_BEST) if c in results]
    peer = max((c for c in PEER_BESTS if c in results), key=lambda c: results[c]["throughput"], default=None)
    native = results.get(TFDATA_NATIVE, {}).get("throughput")
    only = {"vs_limit": LIMIT_WORKLOADS, "every_epoch_vs_dataloader_best": EPOCH_WORKLOADS}
    wanted = [t for t in TARGETS if name in only.get(t.key, (name,))]
    out = {}
    for config in ZERO_KNOB:
        mine = results.get(config, {})
        throughput = mine.get("throughput")
        worst, epoch = _worst_epoch(mine, base)
        ratios = {
            "every_epoch_vs_dataloader_best": worst,
            "vs_best_of_both": _ratio(throughput, max(bests, default=None)),
            "vs_dataloader_best": _ratio(throughput, base.get("throughput")),
            "pss_vs_dataloader_best": _ratio(mine.get("end_pss_mb"), base.get("end_pss_mb")),
            "vs_limit": _ratio(throughput, limit),
            "vs_best_python_peer": _ratio(throughput, results[peer]["throughput"] if peer else None),
            "vs_tfdata_native": _ratio(throughput, native),
        }
        out[config] = {t.key: t.check(ratios[t.key]) for t in wanted}
        out[config]["vs_best_python_peer"]["against"] = peer
        if "every_epoch_vs_dataloader_best" in out[config]:
            out[config]["every_epoch_vs_dataloader_best"]["epoch"] = epoch
    return out


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

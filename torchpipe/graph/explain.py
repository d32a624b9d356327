"""Readable text of a plan (one op a line with its parameters, inputs indented below), and the
same facts as data."""

from __future__ import annotations

from typing import Any

from torchpipe.constants import INFINITE, UNKNOWN
from torchpipe.core.node import Node
from torchpipe.distributed.ranks import describe_rank_split
from torchpipe.distributed.workers import describe_worker_split
from torchpipe.graph.plan import Plan
from torchpipe.ops.passthrough import ElidedNode


def explain_plan(plan: Plan, tuned: dict[str, int] | None = None, running: bool = True) -> str:
    """The pipeline graph as text: root first, each input indented under its consumer; then the
    ``tuned`` values of its AUTOTUNE knobs, now (``running``) or where the last pass left them."""
    lines = ["Pipeline as written (root first):"]
    _render(plan.root, lines, prefix="", is_last=True, is_root=True)
    lines.append("Optimizations:")
    lines.extend(f"  {note}" for note in plan.rewrites or ["(none applied)"])
    lines.append("As it will run:")
    _render(plan.runtime_root, lines, prefix="", is_last=True, is_root=True)
    cardinality = plan.root.cardinality()
    share = (
        ""
        if plan.rank is None
        else f" (this rank's share: {_cardinality_text(plan.runtime_root.cardinality())})"
    )
    lines.append(f"Cardinality: {_cardinality_text(cardinality)}{share}")
    lines.append(f"Options: {plan.options!r}")
    if plan.worker is None and plan.rank is None:
        lines.append(f"In torch DataLoader workers: {describe_worker_split(plan.root)}")
    if plan.rank is None:
        lines.append(f"On several ranks: {describe_rank_split(plan.root, plan.options.distribute)}")
    if tuned:
        lines.append(
            "Autotuned (latest pass, now):" if running else "Autotuned (last pass, at its end):"
        )
        lines.extend(f"  {name} = {value}" for name, value in tuned.items())
    return "\n".join(lines)


def plan_facts(
    plan: Plan, tuned: dict[str, int] | None = None, running: bool = True
) -> dict[str, Any]:
    """What :func:`explain_plan` says, as data (``Dataset.explain(as_dict=True)``).

    Returns:
        A dict with ``"as_written"`` and ``"as_run"``: the pipeline before and after the
        rewrites, each op ``{"op": kind, "label": what explain() prints, "inputs": [...]}``
        from the root (removed ops skipped); ``"rewrites"``: for each rewrite that applied
        (a pass of ``Options.optimizations``, the shard), in order, what it did:
        ``{name: [note, ...]}``; ``"cardinality"``; ``"options"`` (``tp.Options``);
        ``"tuned"``: the AUTOTUNE knobs' values, ``{}`` before a pass ran; and ``"tuned_now"``:
        whether they are those of a live pass (else where the last one left them).
    """
    rewrites: dict[str, list[str]] = {}
    for note in plan.rewrites:
        name, _, what = note.partition(": ")
        rewrites.setdefault(name, []).append(what)
    return {
        "as_written": _facts(plan.root),
        "rewrites": rewrites,
        "as_run": _facts(plan.runtime_root),
        "cardinality": plan.root.cardinality(),
        "options": plan.options,
        "tuned": dict(tuned or {}),
        "tuned_now": running and bool(tuned),
    }


def _facts(node: Node) -> dict[str, Any]:
    while isinstance(node, ElidedNode):  # removed ops: no iterator, nothing to show
        node = node.inputs[0]
    return {
        "op": node.kind,
        "label": node.label(),
        "inputs": [_facts(child) for child in node.inputs],
    }


def _render(
    node: Node, lines: list[str], prefix: str, is_last: bool, is_root: bool = False
) -> None:
    while isinstance(node, ElidedNode):  # removed ops: no iterator, nothing to show
        node = node.inputs[0]
    branch = "" if is_root else ("└─ " if is_last else "├─ ")
    lines.append(f"  {prefix}{branch}{node.label()}")
    child_prefix = prefix if is_root else prefix + ("   " if is_last else "│  ")
    for i, child in enumerate(node.inputs):
        _render(child, lines, child_prefix, is_last=i == len(node.inputs) - 1)


def _cardinality_text(n: int) -> str:
    return {INFINITE: "INFINITE", UNKNOWN: "UNKNOWN"}.get(n, str(n))

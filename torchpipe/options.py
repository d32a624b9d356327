"""Pipeline-wide options, merged along the graph like ``tf.data.Options``."""

from __future__ import annotations

import dataclasses
from typing import Any

OPTIMIZATIONS = (
    "noop_elimination",
    "shuffle_repeat_fusion",
    "vectorize",
    "map_parallelization",
    "map_fusion",
    "filter_fusion",
    "map_filter_fusion",
    "source_pushdown",
    "record_pushdown",
    "map_batch_fusion",
    "inject_prefetch",
)
"""The static optimizer's passes, in the order they run (see ``torchpipe.graph.optimizer``)."""

POLICIES = ("auto", "file", "data", "off")
"""``DistributeOptions.policy`` values: how a pipeline is split between ranks."""
UNEVEN = ("drop", "pad", "allow")
"""``DistributeOptions.uneven`` values: what happens when ranks' shares differ in length."""


@dataclasses.dataclass(frozen=True)
class DistributeOptions:
    """How a pipeline iterated on several ranks (``torch.distributed``) splits its data.

    Where ``torch.distributed`` is initialized with a world size above 1 (torchrun, DDP, FSDP),
    or ``rank`` and ``world_size`` are given, each rank's pass yields that rank's share
    (docs/distributed.md).

    Args:
        policy: ``"auto"`` (the default): ``"file"`` where the pipeline starts from a list of
            files (``tp.list_files``, ``tp.TFRecordDataset``'s or ``tp.from_webdataset``'s) with
            at least ranks x workers of them, else ``"data"``;
            ``"file"``: each rank reads its own files (an error with fewer files than ranks x
            workers); ``"data"``: each rank keeps every N-th element (of the source, after the
            ops that only reorder or select it, where the pipeline has one source that is not a
            file list; else of the output); ``"off"``: every rank gets everything.
        rank: this process's rank; with ``world_size``, instead of ``torch.distributed``'s.
        world_size: the number of ranks; with ``rank``.
        uneven: when ranks' shares differ in length: ``"drop"`` (the default) ends every
            rank's pass where the shortest ends, so no rank runs a step the others do not
            (as ``DistributedSampler(drop_last=True)``); ``"pad"`` runs as long as the longest,
            the others repeating elements from the start of their share (as
            ``DistributedSampler(drop_last=False)``); ``"allow"`` leaves the lengths alone
            (for training loops that handle uneven inputs themselves, e.g. torch's ``Join``).
        global_batch: the batch sizes of the pipeline's ``batch``, ``padded_batch`` and
            ``rebatch`` are global: each rank batches ``batch_size / world_size`` elements (as
            ``tf.distribute`` rebatches); a size that does not divide is a ValueError when the
            pass starts. False (the default): sizes are per rank, as with
            ``DataLoader(batch_size=...)`` and ``DistributedSampler``.

    Raises:
        TypeError, ValueError: for a value of the wrong type or range, or only one of
            ``rank`` and ``world_size``.
    """

    policy: str = "auto"
    rank: int | None = None
    world_size: int | None = None
    uneven: str = "drop"
    global_batch: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"DistributeOptions.policy must be one of {POLICIES}, got {self.policy!r}"
            )
        if self.uneven not in UNEVEN:
            raise ValueError(
                f"DistributeOptions.uneven must be one of {UNEVEN}, got {self.uneven!r}"
            )
        if not isinstance(self.global_batch, bool):
            raise TypeError(
                f"DistributeOptions.global_batch must be a bool, got {self.global_batch!r}"
            )
        for name in ("rank", "world_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"DistributeOptions.{name} must be an int or None, got {value!r}")
        if (self.rank is None) != (self.world_size is None):
            raise ValueError(
                "DistributeOptions: give both rank and world_size, or neither "
                f"(got rank={self.rank!r}, world_size={self.world_size!r})"
            )
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"DistributeOptions.world_size must be >= 1, got {self.world_size}")
        if (
            self.rank is not None
            and self.world_size is not None
            and not 0 <= self.rank < self.world_size
        ):
            raise ValueError(
                f"DistributeOptions.rank must be in [0, {self.world_size}), got {self.rank}"
            )


@dataclasses.dataclass(frozen=True)
class AutotuneOptions:
    """How the autotuner may tune a pipeline's ``tp.AUTOTUNE`` knobs while it runs.

    Args:
        enabled: run the tuner thread. Off, every AUTOTUNE knob keeps its starting value
            (parallelism: the usable cores; a prefetch buffer: 2).
        cpu_budget: cores the pipeline and the training loop together may keep busy; None: the
            usable cores (CPU affinity and the cgroup quota).
        ram_budget: bytes that buffers and elements in flight may hold; None: half the memory
            available when the pass starts.

    Raises:
        TypeError, ValueError: for a value of the wrong type or not positive.
    """

    enabled: bool = True
    cpu_budget: float | None = None
    ram_budget: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"AutotuneOptions.enabled must be a bool, got {self.enabled!r}")
        for name in ("cpu_budget", "ram_budget"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"AutotuneOptions.{name} must be a number or None, got {value!r}")
            if not value > 0:
                raise ValueError(f"AutotuneOptions.{name} must be positive, got {value!r}")


DEFAULT_STALL_TIMEOUT_S = 600.0
"""How long an element may be out in a parallel stage before :class:`~torchpipe.errors.StallError`."""

_DEFAULTS: dict[str, Any] = {
    "seed": None,
    "deterministic": True,
    "restart_workers": True,
    "optimizations": {},
    "autotune": AutotuneOptions(),
    "stall_timeout": DEFAULT_STALL_TIMEOUT_S,
    "trace": False,
    "distribute": DistributeOptions(),
}


class Options:
    """Options that apply to a whole pipeline.

    Only the fields passed to the constructor count as *set*; :meth:`merge` lets set fields
    of the newer options override the older ones and keeps everything else, so
    ``ds.with_options(Options(seed=1)).with_options(Options(deterministic=False))`` has both.

    Args:
        seed: the pipeline seed. It drives every random op that has no seed of its own and the
            per-element seeding of user functions. ``None`` draws a fresh random seed for each
            iterator (the draw is part of the iterator's checkpoint, so a resume is exact).
        deterministic: whether parallel ops deliver elements in input order. Ops with an
            explicit ``deterministic=`` argument ignore this.
        restart_workers: replace a worker process that dies and re-run its unfinished
            elements (each element is still delivered exactly once, in order); if False, a
            dead worker raises ``tp.WorkerError`` naming its pid and signal.
        optimizations: passes of the static optimizer to switch on or off by name, e.g.
            ``{"map_fusion": False}``; passes not named stay on. Merging options merges
            these dicts. See ``OPTIMIZATIONS`` and docs/optimizer.md.
        autotune: a :class:`AutotuneOptions`: whether the autotuner runs, and its budgets.
        stall_timeout: seconds an element may be out in a parallel stage (on a thread, in a
            worker process) before the stage raises ``tp.StallError`` naming the element and
            where it runs, instead of waiting on a hung call forever; ``None`` turns the check
            off. Default 600.
        trace: record the pass for ``it.trace(path)`` (Chrome / Perfetto JSON) and
            ``it.stats().plot(path)`` (a timeline): ``True`` records each stage's elements that
            cost 20 us or more and one in about 16 cheaper ones, every call its threads or worker
            processes run, the training loop's waits, buffer occupancy and the tuner's knob
            changes; ``"all"`` records every element of every stage (finer, dearer on cheap
            elements); ``False`` (default) records nothing and costs nothing (docs/observability.md).
        distribute: a :class:`DistributeOptions`: how the pipeline splits its data between
            ranks when it runs on several (``torch.distributed``).

    Raises:
        TypeError: for an unknown field or a value of the wrong type.
    """

    __slots__ = ("_set",)

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            _validate(name, value)
        if "optimizations" in fields:
            fields["optimizations"] = dict(fields["optimizations"])  # a copy: options are immutable
        object.__setattr__(self, "_set", dict(fields))

    def __getattr__(self, name: str) -> Any:
        if name in _DEFAULTS:
            value = self._set.get(name, _DEFAULTS[name])
            return dict(value) if isinstance(value, dict) else value
        raise AttributeError(f"Options has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Options are immutable; build a new one and merge it")

    def is_set(self, name: str) -> bool:
        """Whether ``name`` was given explicitly (rather than left at its default)."""
        return name in self._set

    def merge(self, newer: Options) -> Options:
        """These options overridden by the fields that ``newer`` sets."""
        if not isinstance(newer, Options):
            raise TypeError(f"expected tp.Options, got {type(newer).__name__}")
        merged = {**self._set, **newer._set}
        if "optimizations" in self._set and "optimizations" in newer._set:
            merged["optimizations"] = {**self._set["optimizations"], **newer._set["optimizations"]}
        return Options(**merged)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and self._set == other._set

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, _hashable(v)) for k, v in self._set.items())))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._set.items())
        return f"Options({body})"

    def __getstate__(self) -> dict[str, Any]:
        return self._set

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_set", dict(state))


def _validate(name: str, value: Any) -> None:
    if name not in _DEFAULTS:
        raise TypeError(f"unknown option {name!r}; expected one of {sorted(_DEFAULTS)}")
    if (
        name == "seed"
        and value is not None
        and (isinstance(value, bool) or not isinstance(value, int))
    ):
        raise TypeError(f"Options.seed must be an int or None, got {value!r}")
    if name == "seed" and value is not None and value < 0:
        raise ValueError(f"Options.seed must be non-negative, got {value}")
    if name in ("deterministic", "restart_workers") and not isinstance(value, bool):
        raise TypeError(f"Options.{name} must be a bool, got {value!r}")
    if name == "optimizations":
        _validate_optimizations(value)
    if name == "stall_timeout" and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"Options.stall_timeout must be a number of seconds or None, got {value!r}"
            )
        if not value > 0:
            raise ValueError(f"Options.stall_timeout must be positive, got {value!r}")
    if name == "trace" and not isinstance(value, (bool, str)):
        raise TypeError(f"Options.trace must be False, True or 'all', got {value!r}")
    if name == "trace" and isinstance(value, str) and value != "all":
        raise ValueError(f"Options.trace must be False, True or 'all', got {value!r}")
    if name == "autotune" and not isinstance(value, AutotuneOptions):
        raise TypeError(f"Options.autotune must be a tp.AutotuneOptions, got {value!r}")
    if name == "distribute" and not isinstance(value, DistributeOptions):
        raise TypeError(f"Options.distribute must be a tp.DistributeOptions, got {value!r}")


def _validate_optimizations(value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"Options.optimizations must be a dict of pass name -> bool, got {value!r}")
    for key, enabled in value.items():
        if key not in OPTIMIZATIONS:
            raise ValueError(
                f"Options.optimizations: unknown pass {key!r}; expected one of {list(OPTIMIZATIONS)}"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"Options.optimizations[{key!r}] must be a bool, got {enabled!r}")


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value

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
    "map_batch_fusion",
    "inject_prefetch",
)
"""The static optimizer's passes, in the order they run (see ``torchpipe.graph.optimizer``)."""



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

_DEFAULTS: dict[str, Any] = {"seed": None, "deterministic": True, "restart_workers": True, "optimizations": {},
                             "autotune": AutotuneOptions(), "stall_timeout": DEFAULT_STALL_TIMEOUT_S,
                             "trace": False}  # fmt: skip


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
    if name == "seed" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"Options.seed must be an int or None, got {value!r}")
    if name == "seed" and value is not None and value < 0:
        raise ValueError(f"Options.seed must be non-negative, got {value}")
    if name in ("deterministic", "restart_workers") and not isinstance(value, bool):
        raise TypeError(f"Options.{name} must be a bool, got {value!r}")
    if name == "optimizations":
        _validate_optimizations(value)
    if name == "stall_timeout" and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Options.stall_timeout must be a number of seconds or None, got {value!r}")
        if not value > 0:
            raise ValueError(f"Options.stall_timeout must be positive, got {value!r}")
    if name == "trace" and not isinstance(value, (bool, str)):
        raise TypeError(f"Options.trace must be False, True or 'all', got {value!r}")
    if name == "trace" and isinstance(value, str) and value != "all":
        raise ValueError(f"Options.trace must be False, True or 'all', got {value!r}")
    if name == "autotune" and not isinstance(value, AutotuneOptions):
        raise TypeError(f"Options.autotune must be a tp.AutotuneOptions, got {value!r}")


def _validate_optimizations(value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"Options.optimizations must be a dict of pass name -> bool, got {value!r}")
    for key, enabled in value.items():
        if key not in OPTIMIZATIONS:
            raise ValueError(f"Options.optimizations: unknown pass {key!r}; expected one of {list(OPTIMIZATIONS)}")
        if not isinstance(enabled, bool):
            raise TypeError(f"Options.optimizations[{key!r}] must be a bool, got {enabled!r}")


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value

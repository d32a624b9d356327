"""A simulated pipeline for the model and tuner tests: made-up, deterministic timings."""

from torchpipe.autotune.model import Stage


def pipeline(map_s=1e-3, step_s=0.0, cpu=1.0, element=0.0):
    """source -> map (parallelism knob ``p``) -> batch (buffer knob ``depth``) -> the consumer's step."""
    return [
        Stage("source", 5e-6),
        Stage("map", map_s, parallelism="p", cpu_fraction=cpu, bytes_per_element=element),
        Stage("batch", 2e-5, buffer="depth", bytes_per_element=element),
        Stage("consumer", step_s),
    ]

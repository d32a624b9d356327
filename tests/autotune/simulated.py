"""A simulated pipeline for the model and tuner tests: made-up, deterministic timings."""

from torchpipe.autotune.model import Stage
from torchpipe.core.iterator import Iterator
from torchpipe.core.tunable import Tunable


def pipeline(map_s=1e-3, step_s=0.0, cpu=1.0, element=0.0):
    """source -> map (parallelism knob ``p``) -> batch (buffer knob ``depth``) -> the consumer's step."""
    return [
        Stage("source", 5e-6),
        Stage("map", map_s, parallelism="p", cpu_fraction=cpu, bytes_per_element=element),
        Stage("batch", 2e-5, buffer="depth", bytes_per_element=element),
        Stage("consumer", step_s),
    ]


class Fake(Iterator, Tunable):
    """An iterator that only has a shape: role, inputs, knobs, pool size and buffer slots."""

    def __init__(
        self,
        name,
        *inputs,
        role=None,
        knob=None,
        knobs=(),
        parallelism=1,
        slots=0,
        in_processes=False,
    ):
        super().__init__(name, *inputs)
        self.tuning_role = role
        self._knobs = [knob] if knob is not None else list(knobs)
        self._parallelism, self._slots, self._in_processes = parallelism, slots, in_processes

    def next(self):
        raise StopIteration

    def get_state(self):
        return {}

    def set_state(self, state):
        pass

    def knobs(self):
        return list(self._knobs)

    def parallelism(self):
        return self._parallelism

    def buffer_slots(self):
        return self._slots

    def calls_in_processes(self):
        return self._in_processes

"""Autotune: a performance model of the running pipeline and the hill-climbing that tunes its knobs."""

from torchpipe.autotune.model import Knob, Stage, predict_time
from torchpipe.autotune.tuner import Budget, hill_climb

__all__ = ["Budget", "Knob", "Stage", "hill_climb", "predict_time"]

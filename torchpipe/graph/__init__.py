"""The logical plan: compiling a Dataset graph into an iterator tree, and explaining it."""

from torchpipe.graph.explain import explain_plan, plan_facts
from torchpipe.graph.plan import PassHistory, PipelineIterator, Plan

__all__ = ["PassHistory", "PipelineIterator", "Plan", "explain_plan", "plan_facts"]

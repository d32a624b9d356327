"""The logical plan: compiling a Dataset graph into an iterator tree, and explaining it."""

from torchpipe.graph.explain import explain_plan
from torchpipe.graph.plan import PassHistory, PipelineIterator, Plan
from torchpipe.graph.sharding import current_worker

__all__ = ["PassHistory", "PipelineIterator", "Plan", "current_worker", "explain_plan"]

"""The DataLoader: torch's arguments and behaviour over torchpipe's runtime.

- ``dataloader``: the facade (:class:`DataLoader`), its arguments, state dicts and stats;
- ``explain``: ``tp.explain``, a DataLoader as written and as it will run;
- ``workers``: the fetch engine: batches as tasks on the runtime's executors, placed by its policy;
- ``replicas``: an IterableDataset's replicas, each with its own worker info and RNG states.
"""

from torchpipe.loader.dataloader import DataLoader
from torchpipe.loader.explain import explain

__all__ = ["DataLoader", "explain"]

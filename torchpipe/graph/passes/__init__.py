"""The static passes, one module each; ``torchpipe.graph.optimizer`` runs them in order."""

"""The argument checks that the sources (``sources.py``) and the readers of ``io/`` use.

They live in :mod:`torchpipe.core.arguments`, below the ops, whose ``check_*`` functions use them
too; this module hands on the names its importers take from it.
"""

from __future__ import annotations

from torchpipe.core.arguments import require_bool, require_int, require_seed

__all__ = ["require_bool", "require_int", "require_seed"]

"""The op contract: what every op is made of, readable in one sitting.

An op is a logical :class:`Node` (immutable parameters and inputs; ``build(ctx)`` makes one pass's
iterator) and a physical :class:`Iterator` (that pass's state). A new op subclasses both; each
class lists what an op implements first, then the hooks it may override, then what the base class
does:

- ``Node``: set ``kind``, implement ``build(ctx)``; override ``params()``, ``cardinality()``,
  ``is_asynchronous()``, ``input_context()``, ``elided_context()`` or ``label()`` where the
  defaults do not fit, and set its traits (class variables the passes and the distribution
  rewrites read instead of lists of kinds): ``checkpoints_as_input``, ``SPEED_PARAMS``,
  ``reorders_only``, ``seekable``, ``holds_no_elements``, ``split_by_hand``, ``given_share``;
- ``Iterator``: implement ``next()``, ``get_state()`` and ``set_state(state)``; override
  ``start()``, ``shutdown()``, ``children()``, ``skip()`` or ``prepare()`` where needed; the base
  class owns lazy start, stats, the closed-state error and the checkpoint plumbing. A pass-through
  op subclasses :class:`PassThroughIterator` instead; an op the autotuner tunes also subclasses
  :class:`Tunable`.

The rest is what ops share: :class:`BuildContext` (where an iterator is built: its seeds),
:class:`UserFunction` (a call of the user's function: seeds, error notes), :class:`PositionLog`
(what an asynchronous op took and handed on, for exact checkpoints), the ``check_*`` helpers for
state values, ``held_elements`` (the structure of elements a state holds), ``stats`` (per-iterator
counters) and ``rewrite`` (copying a graph with a node replaced).
"""

from torchpipe.core.function import UserFunction
from torchpipe.core.iterator import Iterator, PassThroughIterator
from torchpipe.core.node import (
    AUTOTUNE_SYMBOL,
    RANK_MARK,
    BuildContext,
    Node,
    Symbol,
    function_name,
)
from torchpipe.core.position_log import PositionLog
from torchpipe.core.state import check_bool, check_int, check_state
from torchpipe.core.tunable import Tunable

__all__ = [
    "AUTOTUNE_SYMBOL",
    "BuildContext",
    "Iterator",
    "Node",
    "PassThroughIterator",
    "PositionLog",
    "RANK_MARK",
    "Symbol",
    "Tunable",
    "UserFunction",
    "check_bool",
    "check_int",
    "check_state",
    "function_name",
]

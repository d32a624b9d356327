"""The call of a user function: :class:`UserFunction` (seeds, notes, stats)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchpipe.core.node import WORKER_MARK, BuildContext
from torchpipe.errors import add_note
from torchpipe.randomness import (
    call_seeded,
    call_state,
    enter_call,
    exit_call,
    mix_seed,
    seed_global_rngs,
)


class UserFunction:
    """Calls a user function the way every stage does.

    Before each call it makes the element's seed current for ``tp.rng()`` and, when the
    pipeline has a seed, seeds the global RNGs. Exceptions keep their type and get a note
    naming the stage and the element's sequence number; a ``StopIteration`` escaping the
    function becomes a RuntimeError so it cannot silently end the pipeline.

    Args:
        fn: the user's callable.
        stage: the stage name, e.g. ``map(decode)``.
        ctx: the build context (source of the stage seed).
        seed_globals: whether to seed ``random``/numpy/torch before each call: ``None`` when
            the pipeline has a seed (inline calls and worker processes), False never (threads
            share them). Seeding costs about 10 us a call, so pipelines without a seed skip it;
            their worker processes get distinct streams from :meth:`seed_worker` instead.
    """

    __slots__ = ("fn", "stage", "_seed", "_seed_globals")

    def __init__(
        self, fn: Any, stage: str, ctx: BuildContext, seed_globals: bool | None = None
    ) -> None:
        self.fn = fn
        self.stage = stage
        self._seed = ctx.stage_seed()
        self._seed_globals = ctx.seeded if seed_globals is None else seed_globals

    def __call__(self, seq: int, *args: Any) -> Any:
        prev = enter_call(self._seed, seq)
        try:
            if self._seed_globals:
                return call_seeded(mix_seed(self._seed, seq), self.fn, *args)
            return self.fn(*args)
        except StopIteration as e:
            raise self._stopped(seq) from e
        except Exception as e:
            add_note(e, self._where(seq))
            raise
        finally:
            exit_call(prev)

    @property
    def seeds_globals(self) -> bool:
        """Whether each call seeds the global RNGs (the pipeline has a seed)."""
        return self._seed_globals

    def seed_worker(self, slot: int) -> None:
        """In a new worker process: its own global RNG streams, unless calls seed them anyway
        (forked workers would otherwise all repeat the parent's streams)."""
        if not self._seed_globals:
            seed_global_rngs(mix_seed(self._seed, WORKER_MARK, slot))

    def on_elements(
        self,
        first: int,
        elements: list,
        then: Callable[[int, Any], Any] | None = None,
        out: list | None = None,
    ) -> list:
        """:meth:`on_element` for elements numbered from ``first`` on (a batch's): the element's
        seed is made current for each, once entered for all (a call's bookkeeping is most of
        what a cheap function costs). ``then(j, result)``, where given, takes each result while
        it is in the cache (a batch's rows are copied into place). The results are appended to
        ``out`` where given (on an error, the results before it are there) and returned."""
        results = [] if out is None else out
        if self._seed_globals:
            for j, element in enumerate(elements):
                result = self.on_element(first + j, element)
                results.append(result if then is None else then(j, result))
            return results
        fn, seq, state = self.fn, first, call_state()
        prev = enter_call(self._seed, first)
        try:
            for seq, element in enumerate(elements, first):
                state.seq = seq  # this element's tp.rng() (call_state)
                result = fn(*element) if type(element) is tuple else fn(element)
                results.append(result if then is None else then(seq - first, result))
        except StopIteration as e:
            raise self._stopped(seq) from e
        except Exception as e:
            add_note(e, self._where(seq))
            raise
        finally:
            exit_call(prev)
        return results

    def _stopped(self, seq: int) -> RuntimeError:
        """What a StopIteration escaping the function at element ``seq`` becomes (it would
        silently end the pipeline)."""
        return RuntimeError(f"{self.stage} raised StopIteration at element {seq}")

    def _where(self, seq: int) -> str:
        """The note an error raised at element ``seq`` gets."""
        return f"raised in torchpipe stage {self.stage} at element {seq}"

    def on_element(self, seq: int, element: Any) -> Any:
        """Call with ``element``, unpacking a plain tuple into positional arguments (tf.data)."""
        if type(element) is tuple:
            return self(seq, *element)
        return self(seq, element)

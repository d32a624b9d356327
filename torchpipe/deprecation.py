"""Old public names that keep working: a module ``__getattr__`` that hands out the new object for a
renamed name and warns (``DeprecationWarning``) the first time each old name is used."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed_names(
    module: str, renamed: Mapping[str, str], names: Mapping[str, Any]
) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` that resolves each old name of ``renamed`` to its new one.

    Args:
        module: the module's ``__name__``, for the messages.
        renamed: old name -> new name.
        names: the module's namespace (its ``globals()``), where the new names are looked up when an
            old one is used.

    Returns:
        The function to assign to the module's ``__getattr__``; for a name that is neither old nor
        defined it raises ``AttributeError``, as a module without one would.
    """
    warned: set[str] = set()
    lock = threading.Lock()

    def module_getattr(name: str) -> Any:
        if name not in renamed:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = renamed[name]
        with lock:
            first = name not in warned
            warned.add(name)
        if first:
            warnings.warn(
                f"{module}.{name} is deprecated: it was renamed {module}.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
        return names[new]

    return module_getattr

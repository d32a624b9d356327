"""``tp.load(path)``: the dataset ``ds.save(path)`` wrote, as a source read by index.

Saved datasets are one idea in two layers: the format, written and read, is ``storage/``'s
(``storage/save.py`` writes it for ``ds.save``, ``storage/saved_file.SavedRecords`` reads it);
this module is the ``tp.Dataset`` face of the reading half. It cannot sit in ``storage/``, which
lies below ``dataset.py``, nor in ``sources.py``, which imports ``io/`` (so ``tp.io``, which
re-exports :class:`SavedDataset`, would import it back).
"""

from __future__ import annotations

import os
from typing import Any

from torchpipe.dataset import Dataset
from torchpipe.ops.source_nodes import FromDatasetNode
from torchpipe.storage.saved_file import SavedRecords


class SavedDataset(Dataset):
    """A saved dataset (``tp.load(path)``): a ``tp.Dataset`` of known length whose elements are
    read by index, so ``ds[i]`` works, a checkpoint is an index and ``shuffle`` after it
    shuffles indices (docs/save.md).

    Args:
        records: the saved dataset's records.
    """

    def __init__(self, records: SavedRecords) -> None:
        super().__init__(FromDatasetNode(records))
        self.records = records

    def __getitem__(self, index: int) -> Any:
        return self.records[index]

    @property
    def element_spec(self) -> Any:
        """The structure, dtypes and shapes of the elements (``None`` for a size that varies)."""
        return self.records.element_spec

    def __getstate__(self) -> dict[str, Any]:
        return {"records": self.records}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["records"])  # type: ignore[misc]  # this class's own __init__


def load(path: str | os.PathLike, *, trusted: bool = False) -> SavedDataset:
    """The dataset ``ds.save(path)`` wrote, in its order (tf.data's ``Dataset.load``).

    The reading half of ``storage/``'s saved-dataset format, as ``ds.save`` is its writing half:
    the records are read by ``storage.saved_file.SavedRecords``.

    Security: records are pickles, read by a restricted unpickler that rebuilds only plain data
    (None, bool, int, float, complex, str, bytes, tuple, list, dict, OrderedDict, plain
    namedtuples, numpy arrays and scalars, torch tensors) and the classes allowed with
    ``tp.add_safe_globals``; any other type raises :class:`~torchpipe.errors.UntrustedTypeError`
    naming it, before anything of it runs. So loading a directory someone else wrote runs none of
    their code, unless ``trusted=True`` (docs/save.md, "Security").

    Args:
        path: the directory ``ds.save(path)`` wrote.
        trusted: unpickle the records with full pickle: any class loads, and a record can run any
            code. Only for directories that no one you do not trust could write.

    Raises:
        TypeError: if ``path`` is not a path, or ``trusted`` not a bool.
        FileNotFoundError: if ``path`` holds no complete saved dataset (an interrupted save leaves
            none until it is resumed).
        SavedFormatError: if the dataset is damaged or from a newer torchpipe, or its manifest
            names files outside its directory.
        UntrustedTypeError: (reading an element) if it holds a type outside the allow-list.
    """
    if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"load: path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(trusted, bool):
        raise TypeError(f"load: trusted must be a bool, got {type(trusted).__name__}")
    return SavedDataset(SavedRecords(path, trusted=trusted))

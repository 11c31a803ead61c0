"""A committed checkpoint's tensors and values, as the command-line tools see them.

Per-rank variables are expanded: rank ``r``'s entry of ``name`` is listed as
``name/rank<r>`` (a tensor or a value of its own), so exports and diffs keep every rank's
data. Each entry is checked well-formed here (known dtype, pieces with boxes of the
variable's rank), so the tools never meet a malformed index halfway through a file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.errors import CorruptCheckpointError, UnsupportedValueError
from distckpt.format.index import pieces_of, read_index
from distckpt.format.stored import Pieces
from distckpt.signing.keys import TrustedKeys
from distckpt.storage.backend import Store
from distckpt.storage.registry import open_store


@dataclass(frozen=True)
class TensorVar:
    """One stored tensor: ``name`` as the tools show it, ``entry`` as the index holds it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: Pieces  # made as they are iterated: memory follows the index, not the grid
    entry: dict[str, Any]

    @property
    def numpy_dtype(self) -> np.dtype:
        return dtypes.numpy_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.numpy_dtype.itemsize


@dataclass(frozen=True)
class ValueVar:
    """One stored Python value, as distckpt's typed JSON (see :mod:`distckpt.values`)."""

    name: str
    value: Any


@dataclass(frozen=True)
class Catalog:
    """A committed checkpoint opened for the tools: its store (``root``), its ``index``,
    and its tensors and values by name (per-rank entries expanded)."""

    root: Store
    index: dict[str, Any]
    tensors: dict[str, TensorVar]
    values: dict[str, ValueVar]

    @property
    def names(self) -> list[str]:
        """Every tensor and value name, sorted."""
        return sorted([*self.tensors, *self.values])


def per_rank_name(name: str, rank: str | int) -> str:
    """The name the tools give rank ``rank``'s entry of the per-rank variable ``name``."""
    return f"{name}/rank{rank}"


def open_catalog(
    path: str | os.PathLike[str] | Store,
    *,
    tiling: bool = True,
    trusted: TrustedKeys | None = None,
) -> Catalog:
    """Read and check the index of the committed checkpoint at ``path`` (``tiling=False``:
    all but whether each tensor's pieces tile it, which ``verify`` reports itself;
    ``trusted``: it must be signed by one of these keys, see :mod:`distckpt.signing`)."""
    root = open_store(path)
    index = read_index(root, tiling=tiling, trusted=trusted)
    tensors: dict[str, TensorVar] = {}
    values: dict[str, ValueVar] = {}
    for name, entry in sorted(index["variables"].items()):
        kind = entry.get("kind") if isinstance(entry, dict) else None
        if kind == "per_rank" and isinstance(entry.get("ranks"), dict):
            items = [(per_rank_name(name, r), e) for r, e in entry["ranks"].items()]
        else:
            items = [(name, entry)]
        for shown, item in items:
            if shown in tensors or shown in values:  # "w/rank0": of per-rank w, or its own
                raise CorruptCheckpointError(
                    f"{root.url}: variable {shown!r}: the index names it twice (a variable, "
                    "and an entry of a per-rank variable): one of them would be hidden"
                )
            _add(shown, item, tensors, values, index)
    return Catalog(root, index, tensors, values)


def _add(
    name: str,
    entry: Any,
    tensors: dict[str, TensorVar],
    values: dict[str, ValueVar],
    index: dict[str, Any],
) -> None:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"variable {name!r}: malformed index entry")
    kind = entry.get("kind", "value" if "value" in entry else None)
    if kind == "value" and "value" in entry:
        values[name] = ValueVar(name, entry["value"])
        return
    if kind != "tensor":
        raise CorruptCheckpointError(f"variable {name!r}: unknown kind {kind!r} in the index")
    try:
        dtype = str(entry["dtype"])
        shape = tuple(int(n) for n in entry["shape"])
        pieces = pieces_of(index, entry, name)  # checked, each piece of the shape's rank
        dtypes.numpy_dtype(dtype)
    except UnsupportedValueError as exc:
        raise CorruptCheckpointError(f"variable {name!r}: {exc}") from None
    except (KeyError, TypeError, ValueError, IndexError):
        raise CorruptCheckpointError(f"variable {name!r}: malformed index entry") from None
    tensors[name] = TensorVar(name, dtype, shape, pieces, entry)

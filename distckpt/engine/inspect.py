"""Reading what a checkpoint holds without loading it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from distckpt.format.index import read_index


class Variable(NamedTuple):
    """One stored name: tensors have a shape and a dtype; values have ``shape`` None and
    ``dtype`` "value"; per-rank entries have ``dtype`` "per_rank"."""

    name: str
    shape: tuple[int, ...] | None
    dtype: str


def list_variables(path: str | os.PathLike[str]) -> list[Variable]:
    """Every stored name with its shape and dtype, sorted by name.

    >>> for name, shape, dtype in distckpt.list_variables("run/ckpt-10"):  # doctest: +SKIP
    ...     print(name, shape, dtype)
    net/l1.bias (5,) float32
    net/l1.weight (5, 1) float32
    step None value
    """
    return index_variables(read_index(path))


def index_variables(index: Mapping[str, Any]) -> list[Variable]:
    """:func:`list_variables` of an index already read."""
    return [_describe(name, entry) for name, entry in sorted(index["variables"].items())]


def _describe(name: str, entry: dict[str, Any]) -> Variable:
    kind = entry.get("kind")
    if kind == "tensor":
        return Variable(name, tuple(entry["shape"]), entry["dtype"])
    if kind == "per_rank":
        return Variable(name, None, "per_rank")
    return Variable(name, None, "value")

"""What each rank tells the coordinator about its state before a save.

A rank describes each leaf it holds (:class:`Desc`: name, kind, dtype, global shape, its
box, a checksum of a replicated tensor, an encoded value). It sends them in columnar form,
because a job of thousands of ranks holding a thousand variables each would otherwise be
millions of Python objects on the coordinator: its :class:`Schema` (names, kinds, dtypes,
shapes: identical on every rank of an SPMD job, so sent once per distinct schema) and one
integer vector of its boxes (:class:`RankDesc`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt.slices import Box


@dataclass(frozen=True)
class Desc:
    """What one rank holds of one variable (the engine's per-leaf description)."""

    name: str
    kind: str  # "tensor" | "value" | "per_rank"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    box: Box | None = None
    replicated: bool = False
    checksum: int | None = None  # of a replicated tensor's bytes
    value: Any = None  # encoded JSON of a value


class Schema:
    """The leaves one rank holds, without their boxes or contents: names, kinds, dtypes,
    global shapes and which tensors are replicated. Ranks of an SPMD job share one."""

    __slots__ = ("entries", "digest", "slots", "width")

    def __init__(
        self, entries: Sequence[tuple[str, str, str | None, tuple[int, ...] | None, bool]]
    ) -> None:
        self.entries = tuple(entries)
        self.digest = hashlib.blake2b(repr(self.entries).encode(), digest_size=16).digest()
        # Each "tensor" leaf's box takes 2 * ndim integers of the rank's box vector.
        slots: list[int | None] = []
        width = 0
        for _name, kind, _dtype, shape, _rep in self.entries:
            if kind == "tensor" and shape is not None:
                slots.append(width)
                width += 2 * len(shape)
            else:
                slots.append(None)
        self.slots = tuple(slots)
        self.width = width

    def __reduce__(self) -> tuple[Any, ...]:
        return (Schema, (self.entries,))

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class RankDesc:
    """One rank's description: its schema (None where the coordinator's is the same), the
    boxes of its tensor leaves (offsets then lengths, in schema order), its values (by
    name, encoded) and the crc32c of those replicated tensors it was asked to check."""

    schema: Schema | None
    digest: bytes
    boxes: np.ndarray
    values: dict[str, Any] = field(default_factory=dict)
    checksums: dict[str, int] = field(default_factory=dict)


def rank_desc(descs: Sequence[Desc]) -> RankDesc:
    """The columnar description of one rank's per-leaf descriptions."""
    schema = Schema([(d.name, d.kind, d.dtype, d.shape, d.replicated) for d in descs])
    boxes = np.zeros(schema.width, dtype=np.int64)
    values: dict[str, Any] = {}
    checksums: dict[str, int] = {}
    for d, slot in zip(descs, schema.slots, strict=True):
        if slot is not None:
            assert d.box is not None
            n = d.box.ndim
            boxes[slot : slot + n] = d.box.offsets
            boxes[slot + n : slot + 2 * n] = d.box.lengths
        if d.dtype is None:
            values[d.name] = d.value
        if d.checksum is not None:
            checksums[d.name] = d.checksum
    return RankDesc(schema, schema.digest, boxes, values, checksums)

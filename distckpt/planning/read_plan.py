"""The read plan: which stored boxes a restore target needs, as box copies.

One small idea, as in torch.distributed.checkpoint: a copy is a source box (in the stored
piece's own coordinates) and a destination box (in the target's coordinates) of the same
lengths. Resharding from any world size to any other is the intersection of the target's
box with every stored piece's box.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from distckpt.slices import Box
from distckpt.tiling import tiling_problem


class StoredPiece(Protocol):
    @property
    def box(self) -> Box: ...


P = TypeVar("P", bound=StoredPiece)


@dataclass(frozen=True)
class Copy(Generic[P]):
    piece: P
    src: Box  # in the piece's coordinates (its box's origin is 0)
    dst: Box  # in the target's coordinates


def plan_reads(target: Box, pieces: Iterable[P]) -> Iterator[Copy[P]]:
    """Every copy that fills ``target`` (global coordinates) from ``pieces``."""
    for piece in pieces:
        common = piece.box.intersect(target)
        if common is None or common.empty:
            continue
        yield Copy(piece, common.relative_to(piece.box), common.relative_to(target))


def covered(target: Box, copies: Iterable[Copy[P]]) -> bool:
    """Whether the copies fill every element of ``target`` exactly once (proven with
    disjoint boxes: counting elements would take an overlap for the gap it hides)."""
    return tiling_problem([c.dst for c in copies], Box.full(target.lengths)) is None

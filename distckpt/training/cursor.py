"""A data position that survives restarts: a global sample counter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class SampleCursor:
    """Walks a dataset of ``size`` samples (indices ``0..size-1``, repeating forever) in
    global batches of ``batch_size``, and remembers how far it got.

    The position is a global sample counter, the same on every rank, so it is saved once
    and restores on any world size. With ``world_size > 1`` each rank takes its share
    of every global batch (``rank``, ``rank + world_size``, ...)::

        cursor = SampleCursor(size=10, batch_size=2)
        ckpt = distckpt.Checkpoint(iterator=cursor)
        next(cursor)           # [0, 1]
        next(cursor)           # [2, 3]; after a restore, the run continues from here

    Use the indices to pick samples: ``inputs[next(cursor)]``.
    """

    def __init__(self, size: int, batch_size: int, *, rank: int = 0, world_size: int = 1) -> None:
        if size <= 0 or batch_size <= 0:
            raise ValueError(f"size and batch_size must be positive, got {size}, {batch_size}")
        self.size = size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.position = 0  # samples consumed, over all ranks and epochs

    @property
    def epoch(self) -> int:
        """How many full passes over the dataset have been consumed."""
        return self.position // self.size

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        start = self.position
        self.position += self.batch_size
        batch = [(start + i) % self.size for i in range(self.batch_size)]
        return batch[self.rank :: self.world_size]

    def state_dict(self) -> dict[str, Any]:
        """The position, and the shape of the walk it refers to."""
        return {"position": self.position, "size": self.size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the dataset size and batch size may change)."""
        self.position = int(state["position"])

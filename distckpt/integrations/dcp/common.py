"""What the DCP writer and reader share: locations and finished futures."""

from __future__ import annotations

import os
from typing import TypeVar

from torch.futures import Future

T = TypeVar("T")

Location = str | os.PathLike[str]


def done(value: T) -> Future[T]:
    """A future that already holds ``value`` (distckpt's I/O is over when DCP gets it)."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def location(checkpoint_id: Location | None) -> Location:
    """The checkpoint's location, or the error that none was given."""
    if checkpoint_id is None:
        raise ValueError("no checkpoint location: pass one to the constructor or as checkpoint_id")
    return checkpoint_id


def rank_location(path: Location, rank: int) -> str:
    """Where rank ``rank`` commits its own checkpoint when DCP saves without collectives
    (``use_collectives=False``): ``path/rank-<rank>``."""
    text = os.fspath(path)
    if "://" in text:
        return f"{text.rstrip('/')}/rank-{rank}"
    return os.path.join(text, f"rank-{rank}")

"""A restore plan: the named slots of an object graph to fill, and what to do after."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Slot:
    """One name of the graph to restore.

    ``target`` is a tensor, DTensor or :class:`distckpt.Shard` filled in place (its shape
    and dtype must match the checkpoint), or None when the restored value replaces
    whatever was there. ``on_value`` receives the restored value (the target itself when
    filled in place).
    """

    name: str
    target: Any = None
    on_value: Callable[[Any], None] | None = None


@dataclass
class Plan:
    """Slots to fill with one collective read, then finalizers (``load_state_dict`` calls)."""

    slots: list[Slot] = field(default_factory=list)
    finalizers: list[Callable[[], None]] = field(default_factory=list)

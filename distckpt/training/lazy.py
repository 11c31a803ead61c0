"""Lazy saves: an ``optimizer.step()`` waits until the background copy has what it changes.

A lazy save (``Checkpoint.save(..., lazy=True)``) returns before parameters and optimizer
state are copied; the background thread copies them while the next forward and backward
run. Only ``optimizer.step()`` changes them, so a hook before every step of each tracked
optimizer waits for the copies still running (usually none: they finish long before).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from distckpt.engine import background

_guarded: weakref.WeakSet[Any] = weakref.WeakSet()


def _wait_for_snapshot(optimizer: Any, args: Any, kwargs: Any) -> None:
    background.snapshot_barrier()


def guard_optimizer_steps(optimizers: Iterable[Any]) -> None:
    """Make each optimizer's ``step()`` wait for a pending lazy snapshot (once per optimizer)."""
    for opt in optimizers:
        if opt not in _guarded:
            opt.register_step_pre_hook(_wait_for_snapshot)
            _guarded.add(opt)

"""Lazy saves: an ``optimizer.step()`` waits until the background copy has what it changes.

A lazy save (``Checkpoint.save(..., lazy=True)``) returns before parameters and optimizer
state are copied; the background thread copies them while the next forward and backward
run. Only ``optimizer.step()`` changes them, so a hook before every step of each tracked
optimizer waits for the copies still running (usually none: they finish long before).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from distckpt.pipeline import background

_guarded: weakref.WeakSet[Any] = weakref.WeakSet()


def _wait_for_snapshot(optimizer: Any, args: Any, kwargs: Any) -> None:
    background.snapshot_barrier()


def guard_optimizer_steps(optimizers: Iterable[Any]) -> None:
    """Make each optimizer's ``step()`` wait for a pending lazy snapshot (once per optimizer)."""
    for opt in optimizers:
        if opt not in _guarded:
            opt.register_step_pre_hook(_wait_for_snapshot)
            _guarded.add(opt)


def wait_for_snapshot() -> None:
    """Block until a pending lazy save has copied what it reads lazily (at once if none).

    Call it before changing parameters or optimizer state in place outside
    ``optimizer.step()`` (an EMA update, a weight clamp, ``load_state_dict``), or decorate
    such a function with :func:`before_change`.
    """
    background.snapshot_barrier()


F = TypeVar("F", bound=Callable[..., Any])


def before_change(fn: F) -> F:
    """Decorate a function that changes parameters or optimizer state in place, so that it
    first waits for a pending lazy save's copies::

        @distckpt.before_change
        def update_ema(ema, model): ...
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        background.snapshot_barrier()
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

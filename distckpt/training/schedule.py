"""When a :class:`~distckpt.CheckpointManager` saves, and to which tier.

The persistent schedule is the Estimator's: a save is due once the step advanced by
``checkpoint_interval`` (read from ``step_counter``) and ``save_interval_secs`` seconds
passed since the last persistent save; the first save always happens, and
``save(check_interval=False)`` always saves. With a node-local tier, a save that the
persistent schedule does not claim goes to the local tier when its own interval (steps
or seconds since the last save of either tier) has passed.

Decisions are made on rank 0 (it alone reads the clock) and broadcast; every rank then
records the outcome (:meth:`Schedule.saved`), so any rank could decide the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distckpt.errors import CorruptCheckpointError

PERSISTENT = "persistent"
LOCAL = "local"


def step_value(step: Any) -> int:
    """The integer value of a step counter (an int, or a one-element tensor)."""
    if hasattr(step, "item"):
        return int(step.item())
    return int(step)


def due(
    step: int | None,
    now: float,
    last_step: int | None,
    last_time: float | None,
    interval: int | None,
    interval_secs: float | None,
) -> bool:
    """Whether a schedule of ``interval`` steps and ``interval_secs`` seconds since the last
    save (at ``last_step``, ``last_time``) lets a save happen now; the first always does."""
    too_few_steps = (
        interval is not None
        and step is not None
        and last_step is not None
        and step - last_step < interval
    )
    too_soon = (
        interval_secs is not None and last_time is not None and now - last_time < interval_secs
    )
    return not (too_few_steps or too_soon)


@dataclass
class Schedule:
    """The intervals of both tiers and when each last saved."""

    checkpoint_interval: int | None = None
    save_interval_secs: float | None = None
    step_counter: Any = None
    local_interval: int | None = None
    local_interval_secs: float | None = None
    has_local: bool = False
    last_step: int | None = None  # the last persistent save
    last_time: float | None = None
    last_any_step: int | None = None  # the last save of either tier
    last_any_time: float | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_interval is not None:
            if self.step_counter is None:
                raise ValueError("checkpoint_interval needs a step_counter")
            if self.checkpoint_interval < 0:
                raise ValueError(
                    f"checkpoint_interval must be >= 0, got {self.checkpoint_interval}"
                )
        if self.local_interval is not None and self.step_counter is None:
            raise ValueError("a LocalTier interval (in steps) needs the manager's step_counter")

    @property
    def persistent_only(self) -> bool:
        """Whether every save is persistent (no interval: the local tier gets none)."""
        return self.checkpoint_interval is None and self.save_interval_secs is None

    def step(self) -> int | None:
        """The step counter's value now (None without one)."""
        return None if self.step_counter is None else step_value(self.step_counter)

    def tier(self, step: int | None, now: float, check_interval: bool) -> str | None:
        """The tier a save at ``step`` and ``now`` goes to, or None when none is due."""
        if not check_interval or due(
            step,
            now,
            self.last_step,
            self.last_time,
            self.checkpoint_interval,
            self.save_interval_secs,
        ):
            return PERSISTENT
        if self.has_local and due(
            step,
            now,
            self.last_any_step,
            self.last_any_time,
            self.local_interval,
            self.local_interval_secs,
        ):
            return LOCAL
        return None

    def saved(self, tier: str, step: int | None, when: float) -> None:
        """A save of ``tier`` at ``step`` and ``when`` succeeded (every rank)."""
        self.last_any_step, self.last_any_time = step, when
        if tier == PERSISTENT:
            self.last_step, self.last_time = step, when

    def record(self) -> dict[str, Any]:
        """What a local step records of the persistent schedule, so that a job restored
        from it goes on from the last persistent save, not from the local step."""
        return {"last_persistent_step": self.last_step, "last_persistent_time": self.last_time}

    @staticmethod
    def read_record(extra: dict[str, Any], where: str) -> tuple[int | None, float | None]:
        """The step and time of the last persistent save, as :meth:`record` wrote them in
        a local step (checked: it was read from storage)."""
        step, when = extra.get("last_persistent_step"), extra.get("last_persistent_time")
        if not (step is None or (type(step) is int and step >= 0)) or not (
            when is None or (type(when) in (int, float) and 0 <= when < math.inf)
        ):
            raise CorruptCheckpointError(f"{where}: the manager's schedule in it is malformed")
        return step, None if when is None else float(when)

    def restored(self, tier: str | None, record: tuple[int | None, float | None] | None) -> None:
        """A restore of ``tier`` (None: nothing restored) took the job to the step counter's
        value; a local step's ``record`` says when the last persistent save was."""
        if record is not None:
            self.last_step, self.last_time = record
        if tier is not None and self.step_counter is not None:
            self.last_any_step = self.step()
            if tier == PERSISTENT:
                self.last_step = self.last_any_step

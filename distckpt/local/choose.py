"""Which local step a restore takes: the newest that the surviving nodes hold whole.

**Choose** (*one allgather*): each rank lists the committed saves its node directory holds
(:func:`distckpt.local.files.survey`) and whose partitions they are. A save is *whole*
when every rank of the job that saved it is held by some surviving rank, original or
replica. Every rank picks the same one: the newest whole save newer than the newest
persistent checkpoint, or none (:class:`Survey` says why, in words).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from distckpt.comm import Communicator
from distckpt.local import files
from distckpt.storage.backend import Store


@dataclass
class Choice:
    """A whole save of the local tier: its step and token, the world that saved it, and
    which ranks of this job hold each saved rank's partitions; ``run``, the run it is
    of."""

    step: int
    token: str
    world: int
    holders: dict[int, list[int]]
    run: str


@dataclass
class Survey:
    """What the ranks found: the save chosen (or None), and why, in words."""

    choice: Choice | None
    reason: str


def choose(comm: Communicator, store: Store, run: str, newer_than: int | None) -> Survey:
    """Collective: the newest whole save of ``run`` newer than ``newer_than`` (None: any).
    Never raises on one rank alone (the survey skips what it cannot read)."""
    held = files.survey(store, run)
    everyone = comm.allgather([(h.step, h.token, h.world, h.owners) for h in held])
    saves: dict[tuple[int, str], tuple[int, dict[int, list[int]]]] = {}
    for rank, found in enumerate(everyone):
        for step, token, world, owners in found:
            _, holders = saves.setdefault((step, token), (world, {}))
            for owner in owners:
                holders.setdefault(owner, []).append(rank)
    if not saves:
        return Survey(None, "the local tier holds no committed step")
    missing: dict[int, list[int]] = {}
    for (step, token), (world, holders) in sorted(saves.items(), reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        lost = _missing(world, holders)
        if lost:
            missing.setdefault(step, lost)
            continue
        reason = f"local step {step} is held whole by the surviving nodes"
        if missing:
            reason += "; newer " + "; ".join(
                f"step {s} lacks the partitions of saved rank(s) {_ranks(lost)}"
                for s, lost in sorted(missing.items(), reverse=True)
            )
        return Survey(Choice(step, token, world, holders, run), reason)
    if missing:
        reason = "; ".join(
            f"local step {s} lacks the partitions of saved rank(s) {_ranks(lost)}"
            for s, lost in sorted(missing.items(), reverse=True)
        )
    else:
        reason = f"no local step is newer than persistent checkpoint number {newer_than}"
    return Survey(None, reason)


def _missing(world: int, holders: dict[int, list[int]]) -> list[int]:
    """The first saved ranks (nine at most) that no rank holds: a count of the ranks held
    and a few more, never one of ``world`` (a mark may name any world size)."""
    return list(itertools.islice((o for o in range(world) if o not in holders), 9))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")

"""Steps 1 and 2 of a save: every rank describes its state, and the ranks agree on a plan.

A plan is reused while the descriptions it was made from do not change, which in a
training loop is every save after the first: one small gather and one small broadcast,
whatever the number of variables.

1. **Offer** (*gather): each rank sends the fingerprint of its description (its schema
   and boxes: :class:`~distckpt.planning.save_plan.RankDesc`), the id of the plan it holds
   for that fingerprint, if any, its values and the crc32c of the replicated tensors it
   checks at this save.
2. **Decide** (coordinator, *broadcast): if every rank holds the plan the coordinator
   cached for exactly these fingerprints and options, the decision is "reuse" (after
   checking values and checksums); a description that changed anywhere makes it
   "describe", never a stale plan.
3. Only on "describe": **describe** (*gather: each rank's boxes, and its schema unless
   it equals the coordinator's, so an SPMD job sends its names once), then the coordinator
   plans (:func:`~distckpt.planning.save_plan.plan_save`), *broadcasts what every rank
   needs and *scatters each rank's share; every rank caches its work under the plan's id.

Replicated tensors (plain tensors saved by several ranks) must be equal on every rank
that saves them: one rank writes them. Checking that costs a crc32c of each on every rank,
a pass over the replicated state, so it is proportionate: every replicated tensor is
checked when a plan is made; while one is reused, each save checks a rotating
``1/k`` of them, so each is checked at least once every ``k`` saves
(``$DISTCKPT_REPLICA_CHECK``: ``k``, default :data:`REPLICA_CHECK_EVERY`; ``1`` checks
them all at every save, ``0`` only when a plan is made).
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt import settings
from distckpt.comm import Communicator
from distckpt.comm.base import COORDINATOR, scatter
from distckpt.comm.outcome import Failure, coordinate
from distckpt.errors import ValidationError
from distckpt.planning.describe import Desc, RankDesc, Schema, rank_desc
from distckpt.planning.pieces import RankWork, SavePlan, Share, Shared
from distckpt.planning.validate import check_contents, raise_inconsistent

#: Default ``k``: each replicated tensor is checked at least once every ``k`` saves.
REPLICA_CHECK_EVERY = settings.REPLICA_CHECK.built_in
#: Plans kept per process (a job may alternate between a few states).
CACHED_PLANS = 4


def replica_check_every() -> int:
    return settings.REPLICA_CHECK.value()


@dataclass
class _RankPlan:
    """A plan as one rank caches it: its work (token aside) and how often it was used."""

    plan_id: str
    work: RankWork
    saves: int = 0


@dataclass
class _CoordinatorPlan:
    plan: SavePlan
    fingerprints: list[bytes]
    options: tuple[Any, ...]


_RANK_PLANS: OrderedDict[bytes, _RankPlan] = OrderedDict()
_COORDINATOR_PLANS: OrderedDict[str, _CoordinatorPlan] = OrderedDict()


def forget_plans() -> None:
    """Drop every cached plan (the next save of each state plans afresh)."""
    _RANK_PLANS.clear()
    _COORDINATOR_PLANS.clear()


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > CACHED_PLANS:
        cache.popitem(last=False)


@dataclass
class Offer:
    plan_id: str | None
    fingerprint: bytes
    digest: bytes  # of the schema
    values: dict[str, Any]
    checksums: dict[str, int]
    destination: str = ""  # where this rank was asked to save (every rank's must agree)


@dataclass
class Full:
    schema: Schema | None  # None: the coordinator's
    boxes: np.ndarray
    checksums: dict[str, int]  # those not in the offer


@dataclass
class ReusePlan:
    """The coordinator's decision: every rank keeps the plan ``plan_id`` it holds from an
    earlier save, and this save's ``token``."""

    plan_id: str
    token: str


@dataclass
class Describe:
    """The coordinator's decision: every rank describes its state (``digest``, the
    coordinator's schema's), as for a first save."""

    digest: bytes


@dataclass
class Agreed:
    """What the ranks agreed on: this rank's work; on the coordinator also the plan and
    the values for the index, and the transaction begun for the save."""

    work: RankWork
    reused: bool
    plan: SavePlan | None = None
    values: dict[str, Any] | None = None
    begun: Any = None


def fingerprint(desc: RankDesc, rank: int) -> bytes:
    """What identifies rank ``rank``'s description between saves."""
    h = hashlib.blake2b(desc.digest + rank.to_bytes(8, "little"), digest_size=16)
    h.update(np.ascontiguousarray(desc.boxes, dtype=np.int64).tobytes())
    return h.digest()


def agree(
    comm: Communicator,
    descs: list[Desc] | Failure,
    checksum: Callable[[list[str]], dict[str, int]],
    options: tuple[Any, ...],
    plan: Callable[[Sequence[RankDesc]], SavePlan],
    begin: Callable[[str], Any],
    local_error: BaseException | None,
    destination: str = "",
) -> Agreed:
    """Steps 1-2 on every rank. ``descs`` are this rank's descriptions without checksums
    (or its failure); ``checksum(names)`` computes the crc32c of those replicated tensors;
    ``plan`` and ``begin(token)`` (which returns the save's transaction) run on the
    coordinator, which caches plans under ``options``. ``destination`` is where this rank
    was asked to save: the coordinator refuses the save, before beginning it, unless every
    rank names the same one (each rank writes its pieces under its own destination, and
    only the coordinator's is committed). Raises on every rank the first failure of any
    rank."""
    offer: Offer | Failure
    mine: RankDesc | None = None
    replicated: list[str] = []
    cached: _RankPlan | None = None
    if isinstance(descs, Failure):
        offer = descs
    else:
        try:
            mine = rank_desc(descs)
            own = fingerprint(mine, comm.rank)
            cached = _RANK_PLANS.get(own)
            replicated = [d.name for d in descs if d.replicated and d.kind == "tensor"]
            checked = _sample(replicated, cached, comm.size)
            mine.checksums = checksum(checked)
            offer = Offer(
                cached.plan_id if cached else None,
                own,
                mine.digest,
                mine.values,
                mine.checksums,
                destination,
            )
        except Exception as exc:
            local_error, offer = exc, Failure.capture(exc, comm.rank)
    begun: list[Agreed] = []  # the coordinator's agreement, once its transaction began
    offers: list[Offer] = []  # the coordinator's: every rank's offer
    try:

        def reuse_or_describe(gathered: list[Any]) -> Any:
            check_destinations(gathered)
            offers.extend(gathered)
            decision, agreed = decide(offers, options, begin)
            if agreed is not None:
                begun.append(agreed)
            return decision

        decision = coordinate(comm, offer, reuse_or_describe, error=local_error)
        if isinstance(decision, ReusePlan):
            assert cached is not None and cached.plan_id == decision.plan_id
            cached.saves += 1
            work = dataclasses.replace(cached.work, token=decision.token)
            return _finish(begun, work, reused=True)

        # Describe: every rank sends its boxes, and its schema unless it is the coordinator's.
        assert isinstance(decision, Describe)
        full: Full | Failure
        if mine is None:
            assert isinstance(offer, Failure)
            full = offer
        else:
            try:
                rest = [n for n in replicated if n not in mine.checksums]
                more = checksum(rest if comm.size > 1 else [])
                mine.checksums.update(more)
                schema = None if mine.digest == decision.digest else mine.schema
                full = Full(schema, mine.boxes, more)
            except Exception as exc:
                local_error, full = exc, Failure.capture(exc, comm.rank)
        shares: list[Share] | None = None

        def make(fulls: list[Any]) -> Any:
            nonlocal shares
            assert mine is not None
            outcome, shares, agreed = plan_fresh(offers, fulls, mine.schema, options, plan, begin)
            begun.append(agreed)
            return outcome

        plan_id, token, shared = coordinate(comm, full, make, error=local_error)
        share = scatter(comm, shares, root=COORDINATOR)
        work = shared.expand(share, comm.rank, token)
        assert isinstance(offer, Offer)
        _remember(_RANK_PLANS, offer.fingerprint, _RankPlan(plan_id, work))
        return _finish(begun, work, reused=False)
    except BaseException:
        # A failure after the coordinator began the save (another rank's error, a dead
        # rank): never leave its transaction behind, its heartbeat keeping it alive.
        for agreed in begun:
            agreed.begun.abort()
        raise


def check_destinations(offers: Sequence[Offer]) -> None:
    """Coordinator: refuse a save whose ranks were given different places to save to."""
    first = offers[0].destination
    others = [(rank, o.destination) for rank, o in enumerate(offers) if o.destination != first]
    if others:
        shown = "; ".join(f"rank {rank}: {where!r}" for rank, where in others[:4])
        more = f" (and {len(others) - 4} more ranks)" if len(others) > 4 else ""
        raise ValidationError(
            f"cannot save: every rank must save to the same place; rank 0 (the "
            f"coordinator) was given {first!r}, but {shown}{more}"
        )


def _finish(begun: list[Agreed], work: RankWork, *, reused: bool) -> Agreed:
    if begun:
        begun[0].work = work
        return begun[0]
    return Agreed(work, reused=reused)


def _sample(replicated: list[str], cached: _RankPlan | None, world: int) -> list[str]:
    """The replicated tensors this rank checks now: all without a cached plan, else the
    rotating share of this save (see the module's docstring); none on one rank."""
    if world == 1:
        return []
    if cached is None:
        return replicated
    k = replica_check_every()
    if k == 0:
        return []
    turn = (cached.saves + 1) % k
    return [name for i, name in enumerate(replicated) if i % k == turn]


def _values(plan: SavePlan, offers: Sequence[Offer]) -> dict[str, Any]:
    """The values for the index: a value as the lowest rank holding it has it (all agree,
    see :func:`check_contents`), a per-rank value by rank."""
    kinds = {s.name: s.kind for s in plan.specs}
    values: dict[str, Any] = {}
    for rank, offer in enumerate(offers):
        for name, value in offer.values.items():
            if kinds.get(name) == "value":
                values.setdefault(name, value)
            elif kinds.get(name) == "per_rank":
                values.setdefault(name, {})[rank] = value
    return values


def decide(
    offers: list[Any], options: tuple[Any, ...], begin: Callable[[str], Any]
) -> tuple[ReusePlan | Describe, Agreed | None]:
    """Coordinator: reuse the cached plan if every rank offers it for the fingerprints
    it was made from (checking the values and checksums offered; ``begin(token)`` then
    begins the save), else ask for descriptions."""
    first: Offer = offers[0]
    cached = _COORDINATOR_PLANS.get(first.plan_id) if first.plan_id else None
    if (
        cached is None
        or cached.options != options
        or any(o.plan_id != first.plan_id for o in offers)
        or cached.fingerprints != [o.fingerprint for o in offers]
    ):
        return Describe(first.digest), None
    plan = cached.plan
    kinds = {s.name: s.kind for s in plan.specs}
    ranks = [RankDesc(None, o.digest, _NO_BOXES, o.values, o.checksums) for o in offers]
    raise_inconsistent(check_contents(kinds, ranks))
    _COORDINATOR_PLANS.move_to_end(first.plan_id)  # type: ignore[arg-type]
    token = uuid.uuid4().hex[:16]
    agreed = Agreed(RankWork(token, [], [], []), True, plan, _values(plan, offers), begin(token))
    return ReusePlan(first.plan_id, token), agreed  # type: ignore[arg-type]


_NO_BOXES = np.zeros(0, dtype=np.int64)


def plan_fresh(
    offers: list[Offer],
    fulls: list[Full],
    schema: Schema | None,
    options: tuple[Any, ...],
    plan: Callable[[Sequence[RankDesc]], SavePlan],
    begin: Callable[[str], Any],
) -> tuple[tuple[str, str, Shared], list[Share], Agreed]:
    """Coordinator: plan from every rank's offer and description, begin the save, cache
    the plan; returns what to broadcast, the shares to scatter and the agreement."""
    ranks = []
    for offer, full in zip(offers, fulls, strict=True):
        checksums = {**offer.checksums, **full.checksums}
        ranks.append(
            RankDesc(
                full.schema if full.schema is not None else schema,
                offer.digest,
                full.boxes,
                offer.values,
                checksums,
            )
        )
    made = plan(ranks)
    shares = made.shares()
    plan_id = uuid.uuid4().hex
    token = uuid.uuid4().hex[:16]
    agreed = Agreed(RankWork(token, [], [], []), False, made, _values(made, offers), begin(token))
    _remember(
        _COORDINATOR_PLANS,
        plan_id,
        _CoordinatorPlan(made, [o.fingerprint for o in offers], options),
    )
    return (plan_id, token, made.shared), shares, agreed

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt import settings
from distckpt.comm import Communicator
from distckpt.comm.base import COORDINATOR, scatter
from distckpt.comm.outcome import Failure, collect, deliver
from distckpt.commit.transaction import Transaction, begin
from distckpt.engine.local_state import Described, LocalState, replica_checksums
from distckpt.errors import ValidationError
from distckpt.pipeline.options import compression_key
from distckpt.planning.describe import RankDesc, Schema, rank_desc
from distckpt.planning.pieces import RankWork, SavePlan, Share, Shared
from distckpt.planning.save_plan import DEFAULT_INNER_BYTES, DEFAULT_SMALL_BYTES, plan_save
from distckpt.planning.validate import check_contents, raise_inconsistent
from distckpt.storage.backend import Store

#: Default ``k``: each replicated tensor is checked at least once every ``k`` saves.
REPLICA_CHECK_EVERY = settings.REPLICA_CHECK.built_in
#: Plans kept per process (a job may alternate between a few states).
CACHED_PLANS = 4


def replica_check_every() -> int:
    return settings.REPLICA_CHECK.value()


@dataclass(frozen=True)
class Terms:
    """What the coordinator plans with, for ``world`` ranks: a plan is cached under its
    terms and reused only under equal ones (:meth:`key`)."""

    world: int
    small_bytes: int = DEFAULT_SMALL_BYTES
    inner_bytes: int = DEFAULT_INNER_BYTES
    compression: Any = None  # a choice, or an ordered mapping of name patterns to choices

    def key(self) -> tuple[Any, ...]:
        """The terms as a hashable value (compression choices in their order)."""
        choices = compression_key(self.compression)
        return (self.world, self.small_bytes, self.inner_bytes, choices)

    def plan(self, ranks: Sequence[RankDesc]) -> SavePlan:
        return plan_save(
            ranks,
            small_bytes=self.small_bytes,
            inner_bytes=self.inner_bytes,
            compression=self.compression,
        )


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
    terms: tuple[Any, ...]


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
class Fresh:
    """A plan the coordinator made (and cached as ``plan_id``): what it broadcasts, and
    each rank's share, which it scatters."""

    plan_id: str
    token: str
    plan: SavePlan
    shares: list[Share]

    def announced(self) -> tuple[str, str, Shared]:
        return self.plan_id, self.token, self.plan.shared


@dataclass
class Agreed:
    """What the ranks agreed on: this rank's work; on the coordinator also the plan, the
    values for the index and the transaction of the save, begun."""

    work: RankWork
    reused: bool
    plan: SavePlan | None = None
    values: dict[str, Any] | None = None
    transaction: Transaction | None = None


@dataclass
class _Mine:
    """This rank's side: its state and description, its fingerprint, the plan it holds
    for it and the names of its replicated tensors."""

    local: LocalState
    desc: RankDesc
    fingerprint: bytes
    cached: _RankPlan | None
    replicated: list[str]


def fingerprint(desc: RankDesc, rank: int) -> bytes:
    """What identifies rank ``rank``'s description between saves."""
    h = hashlib.blake2b(desc.digest + rank.to_bytes(8, "little"), digest_size=16)
    h.update(np.ascontiguousarray(desc.boxes, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(frozen=True)
class Target:
    """Where the save goes: the coordinator begins it there once the ranks agree (every
    rank names it in its offer, and the coordinator refuses a save whose ranks differ)."""

    store: Store
    overwrite: bool = False

    def begin(self, plan: SavePlan, offers: Sequence[Offer], token: str, reused: bool) -> Agreed:
        """Coordinator: the agreement on ``plan``, the save begun."""
        transaction = begin(self.store, token, len(offers), overwrite=self.overwrite)
        work = RankWork(token, [], [], [])
        return Agreed(work, reused, plan, values_for_index(plan, offers), transaction)


def agree(
    comm: Communicator,
    described: Described | Failure,
    error: BaseException | None,
    terms: Terms,
    target: Target,
) -> Agreed:
    """The three steps of the module's docstring, on every rank. ``described`` is this
    rank's state and descriptions, or its failure (``error`` is then this rank's
    exception, raised as itself). The coordinator plans under ``terms`` and begins the
    save at ``target``. Every rank returns its work, or raises the first failure of any
    rank, the save begun aborted."""
    mine, offer, error = _offer(comm, described, error, target)
    decision, offers, agreed, error = _decide(comm, offer, error, terms, target)
    if isinstance(decision, ReusePlan):
        assert mine is not None and mine.cached is not None
        assert mine.cached.plan_id == decision.plan_id
        mine.cached.saves += 1
        return _agreed(agreed, dataclasses.replace(mine.cached.work, token=decision.token), True)
    full, error = _full(comm, mine, offer, error, decision)
    return _plan(comm, mine, offers, full, error, terms, target)


def _offer(
    comm: Communicator, described: Described | Failure, error: BaseException | None, target: Target
) -> tuple[_Mine | None, Offer | Failure, BaseException | None]:
    """Step 1 (this rank): its fingerprint, the plan it holds for it, values, checksums."""
    if isinstance(described, Failure):
        return None, described, error
    try:
        local, descs = described.local, described.descs
        desc = rank_desc(descs)
        own = fingerprint(desc, comm.rank)
        cached = _RANK_PLANS.get(own)
        replicated = [d.name for d in descs if d.replicated and d.kind == "tensor"]
        desc.checksums = replica_checksums(local, _sample(replicated, cached, comm.size))
        plan_id = cached.plan_id if cached else None
        offer = Offer(plan_id, own, desc.digest, desc.values, desc.checksums, target.store.url)
        return _Mine(local, desc, own, cached, replicated), offer, error
    except Exception as exc:
        return None, Failure.capture(exc, comm.rank), exc


def _decide(
    comm: Communicator,
    offer: Offer | Failure,
    error: BaseException | None,
    terms: Terms,
    target: Target,
) -> tuple[ReusePlan | Describe, list[Offer] | None, Agreed | None, BaseException | None]:
    """Step 2 (*gather, coordinator, *broadcast): the decision, and on the coordinator
    every rank's offer and, when the plan is reused, the save begun."""
    offers = collect(comm, offer)
    decision: ReusePlan | Describe | Failure | None = None
    agreed: Agreed | None = None
    if not isinstance(offers, list):  # another rank, or a rank's failure
        decision = offers
    else:
        try:
            check_destinations(offers)
            decision, plan = decide(offers, terms)
            if isinstance(decision, ReusePlan):
                assert plan is not None
                agreed = target.begin(plan, offers, decision.token, reused=True)
        except Exception as exc:
            error, decision = exc, Failure.capture(exc, comm.rank)
    try:
        decided = deliver(comm, decision, error)
    except BaseException:
        abort_begun(agreed)
        raise
    return decided, offers if isinstance(offers, list) else None, agreed, error


def _full(
    comm: Communicator,
    mine: _Mine | None,
    offer: Offer | Failure,
    error: BaseException | None,
    decision: Describe,
) -> tuple[Full | Failure, BaseException | None]:
    """Step 3, this rank's part: its description in full (its boxes, the checksums its
    offer left out, its schema unless it is the coordinator's)."""
    if mine is None:
        assert isinstance(offer, Failure)
        return offer, error
    try:
        rest = [n for n in mine.replicated if n not in mine.desc.checksums]
        more = replica_checksums(mine.local, rest if comm.size > 1 else [])
        mine.desc.checksums.update(more)
        schema = None if mine.desc.digest == decision.digest else mine.desc.schema
        return Full(schema, mine.desc.boxes, more), error
    except Exception as exc:
        return Failure.capture(exc, comm.rank), exc


def _plan(
    comm: Communicator,
    mine: _Mine | None,
    offers: list[Offer] | None,
    full: Full | Failure,
    error: BaseException | None,
    terms: Terms,
    target: Target,
) -> Agreed:
    """Step 3 (*gather, coordinator, *broadcast, *scatter): the coordinator plans from
    every rank's description, begins the save and sends each rank its share; every rank
    caches its work under the plan's id."""
    fulls = collect(comm, full)
    outcome: tuple[str, str, Shared] | Failure | None = None
    fresh: Fresh | None = None
    agreed: Agreed | None = None
    if not isinstance(fulls, list):
        outcome = fulls
    else:
        try:
            assert mine is not None and offers is not None
            fresh = plan_fresh(offers, fulls, mine.desc.schema, terms)
            agreed = target.begin(fresh.plan, offers, fresh.token, reused=False)
            outcome = fresh.announced()
        except Exception as exc:
            error, outcome = exc, Failure.capture(exc, comm.rank)
    try:
        plan_id, token, shared = deliver(comm, outcome, error)
        share = scatter(comm, fresh.shares if fresh else None, root=COORDINATOR)
    except BaseException:
        abort_begun(agreed)
        raise
    work = shared.expand(share, comm.rank, token)
    assert mine is not None
    _remember(_RANK_PLANS, mine.fingerprint, _RankPlan(plan_id, work))
    return _agreed(agreed, work, False)


def abort_begun(agreed: Agreed | None) -> None:
    """A failure after the coordinator began the save (another rank's error, a dead
    rank): never leave its transaction behind, its heartbeat keeping it alive. A no-op
    on the other ranks, which hold none; never raises."""
    if agreed is not None and agreed.transaction is not None:
        agreed.transaction.abort()


def _agreed(began: Agreed | None, work: RankWork, reused: bool) -> Agreed:
    if began is None:
        return Agreed(work, reused=reused)
    return dataclasses.replace(began, work=work)


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


def values_for_index(plan: SavePlan, offers: Sequence[Offer]) -> dict[str, Any]:
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


def decide(offers: list[Offer], terms: Terms) -> tuple[ReusePlan | Describe, SavePlan | None]:
    """Coordinator: reuse the cached plan (returned with the decision) if every rank offers
    it for the fingerprints it was made from, under the same ``terms`` (checking the values
    and checksums offered), else ask for descriptions."""
    first = offers[0]
    cached = _COORDINATOR_PLANS.get(first.plan_id) if first.plan_id else None
    if (
        first.plan_id is None
        or cached is None
        or cached.terms != terms.key()
        or any(o.plan_id != first.plan_id for o in offers)
        or cached.fingerprints != [o.fingerprint for o in offers]
    ):
        return Describe(first.digest), None
    kinds = {s.name: s.kind for s in cached.plan.specs}
    ranks = [RankDesc(None, o.digest, _NO_BOXES, o.values, o.checksums) for o in offers]
    raise_inconsistent(check_contents(kinds, ranks))
    _COORDINATOR_PLANS.move_to_end(first.plan_id)
    return ReusePlan(first.plan_id, uuid.uuid4().hex[:16]), cached.plan


_NO_BOXES = np.zeros(0, dtype=np.int64)


def plan_fresh(
    offers: Sequence[Offer], fulls: Sequence[Full], schema: Schema | None, terms: Terms
) -> Fresh:
    """Coordinator: plan from every rank's offer and description under ``terms``, and
    cache the plan (``schema``: the coordinator's, for ranks that sent none)."""
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
    made = terms.plan(ranks)
    fresh = Fresh(uuid.uuid4().hex, uuid.uuid4().hex[:16], made, made.shares())
    fingerprints = [o.fingerprint for o in offers]
    _remember(_COORDINATOR_PLANS, fresh.plan_id, _CoordinatorPlan(made, fingerprints, terms.key()))
    return fresh

"""A simulated large job: the coordinator's planning driven in one process with the
descriptions of N ranks, without writing data (the scale test and benchmark share it).

The state is FSDP-like: ``layers`` weight matrices split on dim 0 over every rank as
DTensor's ``Shard(0)`` splits them (``torch.chunk``: ranks past the last row hold empty
boxes), small norm weights split the same way (plain chunks gathered to a writer),
replicated tensors on every rank, a per-rank RNG state and two values.
"""

from __future__ import annotations

import json
import math
import pickle
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.engine import agree
from distckpt.engine.commit import Report, build_index, index_bytes
from distckpt.format.stored import Pieces
from distckpt.planning.describe import RankDesc, Schema
from distckpt.planning.pieces import Piece, SavePlan
from distckpt.planning.read_plan import plan_reads
from distckpt.slices import Box, chunk_bounds

#: Shapes of the sharded weights, cycled (a transformer's projections).
SHAPES = ((16384, 4096), (4096, 16384), (4096, 4096), (1024, 4096))
NORM = 8192  # elements of a small norm weight (bfloat16: 16 KiB)
REPLICATED = (("rope.cos", (8192, 64)), ("rope.sin", (8192, 64)), ("scale", (4096,)))


@dataclass
class Job:
    world: int
    schema: Schema
    ranks: list[RankDesc]
    offers: list[agree.Offer]
    fulls: list[agree.Full]


def job(world: int, layers: int = 1000, norms: int = 100) -> Job:
    """The descriptions of ``world`` ranks holding ``layers`` sharded weights, ``norms``
    small sharded norm weights, three replicated tensors, a per-rank RNG state and two
    values."""
    entries: list[tuple[str, str, str | None, tuple[int, ...] | None, bool]] = []
    for i in range(layers):
        entries.append((f"model/layers.{i}.weight", "tensor", "bfloat16", SHAPES[i % 4], False))
    for i in range(norms):
        entries.append((f"model/norms.{i}.weight", "tensor", "bfloat16", (NORM,), False))
    for name, shape in REPLICATED:
        entries.append((f"model/{name}", "tensor", "float32", shape, True))
    entries.append(("rng", "per_rank", "uint8", (5056,), False))
    entries.append(("step", "value", None, None, False))
    entries.append(("epoch", "value", None, None, False))
    schema = Schema(entries)
    # Each rank's box vector, built for all ranks at once: (world, width).
    boxes = np.zeros((world, schema.width), dtype=np.int64)
    rows = np.arange(world)
    for (_, _, _, shape, replicated), slot in zip(schema.entries, schema.slots, strict=True):
        if slot is None or shape is None:
            continue
        d = len(shape)
        boxes[:, slot + d : slot + 2 * d] = shape  # lengths: whole dimensions ...
        if replicated:
            continue
        size = -(-shape[0] // world)  # ... but dim 0, split as torch.chunk splits it
        start = np.minimum(rows * size, shape[0])
        boxes[:, slot] = start
        boxes[:, slot + d] = np.minimum(start + size, shape[0]) - start
    values = {"step": 1000, "epoch": 3}  # typed JSON, as values.encode writes them
    ranks = [RankDesc(schema, schema.digest, boxes[r].copy(), dict(values)) for r in range(world)]
    offers = [
        agree.Offer(None, agree.fingerprint(d, r), schema.digest, d.values, {})
        for r, d in enumerate(ranks)
    ]
    fulls = [agree.Full(schema if r == 0 else None, ranks[r].boxes, {}) for r in range(world)]
    return Job(world, schema, ranks, offers, fulls)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _peak(fn: Callable[[], Any]) -> int:
    """The peak bytes ``fn()`` allocates (tracemalloc, which slows it: timed apart)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def stored_size(piece: Piece) -> int:
    """The bytes a piece takes when written raw (see :mod:`distckpt.format.shard_io`):
    a plain chunk and its crc32c, or a shard with every inner chunk present."""
    itemsize = dtypes.itemsize(piece.dtype)
    if piece.inner is None:
        return math.prod(piece.block) * itemsize + 4
    chunks = math.prod(b // i for b, i in zip(piece.block, piece.inner))
    return chunks * (20 + math.prod(piece.inner) * itemsize + 4) + 4


def reports(plan: SavePlan) -> list[Report]:
    """Every rank's report of a save that wrote the plan (crcs made up, sizes as a raw
    save stores the pieces)."""
    sizes = np.zeros(plan.pieces, dtype=np.int64)
    for spec in plan.specs:
        if spec.layout == "regular" and spec.count:  # every shard a block of chunks
            shared = plan.shared
            piece = spec.piece(0, 0, None, shared.small_bytes, shared.inner_bytes)
            sizes[spec.first : spec.first + spec.count] = stored_size(piece)
            continue
        for piece in plan.pieces_of(spec, sources=False):
            sizes[piece.id] = stored_size(piece)
    order = np.argsort(plan.writers, kind="stable")
    cuts = np.searchsorted(plan.writers[order], np.arange(plan.world_size + 1))
    out = []
    for r in range(plan.world_size):
        mine = order[cuts[r] : cuts[r + 1]]
        out.append(Report(mine, sizes[mine], (mine * 2654435761) % (1 << 32)))
    return out


def read_plan(index: dict[str, Any], rank: int, world: int) -> int:
    """Rank ``rank`` of ``world`` plans its reads of every sharded weight (split on dim 0
    over ``world``) from the index; returns the number of copies."""
    copies = 0
    for name, entry in index["variables"].items():
        if entry.get("kind") != "tensor":
            continue
        shape = tuple(entry["shape"])
        start, size = chunk_bounds(shape[0], world, rank)
        box = Box((start, *([0] * (len(shape) - 1))), (size, *shape[1:]))
        pieces = Pieces(entry, name)
        copies += sum(1 for _ in plan_reads(box, pieces.covering(box)))
    return copies


def measure(
    world: int, layers: int = 1000, load_world: int | None = None, *, peak: bool = True
) -> dict[str, Any]:
    """One simulated save and load plan for ``world`` ranks; times in seconds, sizes in
    bytes. ``load_world`` (default: 3/4 of ``world``) is the world of the resharded load;
    ``peak`` plans once more under tracemalloc for the planning's peak memory."""
    agree.forget_plans()
    sim = job(world, layers)
    terms = agree.Terms(world)

    def first() -> agree.Fresh:
        agree.forget_plans()
        return agree.plan_fresh(sim.offers, sim.fulls, sim.schema, terms)

    memory = {"plan_peak_bytes": _peak(first)} if peak else {}
    fresh, t_plan = _timed(first)
    plan, shared = fresh.plan, fresh.plan.shared
    for offer in sim.offers:
        offer.plan_id = fresh.plan_id
    decision, t_reuse = _timed(lambda: agree.decide(sim.offers, terms))
    assert isinstance(decision[0], agree.ReusePlan), decision
    share_bytes = [len(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)) for s in fresh.shares]
    values = agree.values_for_index(plan, sim.offers)
    doc, t_index = _timed(lambda: index_bytes(build_index(plan, reports(plan), values)))
    index, t_parse = _timed(lambda: json.loads(doc)["attributes"]["distckpt"])
    load_world = load_world or world * 3 // 4
    rank = load_world // 2 + 1
    copies, t_read = _timed(lambda: read_plan(index, rank, load_world))
    agree.forget_plans()
    return {
        "ranks": world,
        "variables": len(plan.specs),
        "pieces": plan.pieces,
        "plan_s": t_plan,
        **memory,
        "reuse_s": t_reuse,
        "reuse_ratio": t_reuse / t_plan,
        "shared_bytes": len(pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL)),
        "share_bytes_max": max(share_bytes),
        "share_bytes_mean": sum(share_bytes) / len(share_bytes),
        "index_bytes": len(doc),
        "index_s": t_index,
        "index_parse_s": t_parse,
        "load_world": load_world,
        "read_plan_s": t_read,
        "read_copies": copies,
    }


def per_rank_and_variable(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    """``key`` per rank and variable, for each row: flat when growth is linear."""
    return [row[key] / (row["ranks"] * row["variables"]) for row in rows]

"""The save plan: once every rank's description is valid, decide who writes what, where.

:func:`plan_save` runs on the coordinator over the descriptions gathered from every rank
(:class:`~distckpt.planning.describe.RankDesc`), validated by
:mod:`distckpt.planning.validate`. It is a pure function: tests and the scale benchmark
feed it synthetic descriptions of thousands of ranks. The planner works per variable on
arrays over the ranks holding it; what it produces is :mod:`distckpt.planning.pieces`.

Decisions, per variable:

* **values** go into the index, after checking that every rank that has one agrees;
* **small tensors** (at most ``small_bytes``) become one plain-chunk array written by one
  rank; the ranks holding its boxes send their bytes to that writer, so small tensors
  never become thousands of tiny files;
* **regular partitions** (``torch.chunk``-style grids, replicated tensors) become one
  array whose shards are the partition's boxes: each rank writes whole shard files it
  owns, never a file another rank writes;
* **irregular partitions** become a group with one array per box (``p0``, ``p1``, ...);
* **per-rank tensors** become a group with one array per rank (``r0``, ``r1``, ...).

Each sharded piece of a variable is compressed as ``compression`` chooses for its name
(:func:`distckpt.format.codecs.choose`); plain chunks never are.

Identical boxes on several ranks are replicas: exactly one of them writes. Writers are
chosen greedily by bytes, largest variable first, so the work spreads over the ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from distckpt import dtypes
from distckpt.format import codecs
from distckpt.format.codecs import Compression
from distckpt.naming import zarr_path
from distckpt.planning.describe import Desc, RankDesc, rank_desc
from distckpt.planning.layout import inner_chunks
from distckpt.planning.pieces import (
    DEFAULT_INNER_BYTES,
    DEFAULT_SMALL_BYTES,
    SavePlan,
    Shared,
    VarSpec,
)
from distckpt.planning.validate import Holders, Partition, checked

_NONE = np.zeros(0, dtype=np.int64)

#: Bytes of gathered small tensors per writing rank: few writers keep the number of
#: gathers (one per writer) small, enough of them keep each writer's share of files small.
SMALL_WRITER_BYTES = 4 * 1024 * 1024


def plan_save(
    ranks: Sequence[RankDesc],
    *,
    small_bytes: int = DEFAULT_SMALL_BYTES,
    inner_bytes: int = DEFAULT_INNER_BYTES,
    compression: Compression = None,
) -> SavePlan:
    """Validate every rank's description and plan the writes (coordinator only).

    Raises :class:`ValidationError` naming every inconsistent variable and the ranks
    involved; nothing is written before this has passed.
    """
    world = len(ranks)
    codecs.check(compression)
    planners = checked(ranks)
    load = np.zeros(world, dtype=np.int64)
    small_writers = _small_writers(planners, world, small_bytes)
    # Largest first, so the greedy balance spreads big tensors before small ones.
    planners.sort(key=lambda hp: (-hp[0].nbytes, hp[0].name))
    planned: list[tuple[VarSpec, np.ndarray, dict[int, np.ndarray]]] = []
    for h, maybe in planners:
        choice = codecs.choose(compression, h.name)
        path = zarr_path(h.name)
        if h.kind == "value":
            planned.append((VarSpec(h.name, "value", path), _NONE, {}))
        elif h.kind == "per_rank":
            planned.append(_plan_per_rank(h, path, choice, load))
        else:
            assert maybe is not None
            planned.append(
                _plan_tensor(h, maybe, path, choice, load, small_writers, small_bytes, inner_bytes)
            )
    planned.sort(key=lambda p: p[0].name)
    specs: list[VarSpec] = []
    writers: list[np.ndarray] = []
    sources: dict[int, np.ndarray] = {}
    first = 0
    for spec, var_writers, var_sources in planned:
        specs.append(_with_first(spec, first, len(var_writers)))
        writers.append(var_writers)
        sources.update((first + k, s) for k, s in var_sources.items())
        first += len(var_writers)
    all_writers = np.concatenate(writers) if writers else _NONE
    gathering = {
        int(all_writers[pid])
        for pid, rows in sources.items()
        if np.any(rows[:, 0] != all_writers[pid])
    }
    shared = Shared(specs, sorted(gathering), small_bytes, inner_bytes)
    return SavePlan(world, shared, all_writers, sources, _groups(specs))


def _with_first(spec: VarSpec, first: int, count: int) -> VarSpec:
    return dataclasses.replace(spec, first=first, count=count)


def _pick(
    load: np.ndarray, ranks: np.ndarray, box_of: np.ndarray, nbytes: np.ndarray
) -> np.ndarray:
    """The writer of each distinct box: the least loaded of its holders (the lowest rank
    on a tie), then their loads grow by the boxes' bytes. Exact greedy: a rank holds one
    box of a variable, so no two boxes share a candidate."""
    held = box_of >= 0
    r, b = ranks[held], box_of[held]
    order = np.lexsort((r, load[r], b))
    b_sorted = b[order]
    firsts = np.ones(len(order), dtype=bool)
    firsts[1:] = b_sorted[1:] != b_sorted[:-1]
    writers = np.empty(len(nbytes), dtype=np.int64)
    writers[b_sorted[firsts]] = r[order][firsts]
    np.add.at(load, writers, nbytes)
    return writers


def _plan_tensor(
    h: Holders,
    part: Partition,
    path: str,
    choice: str | None,
    load: np.ndarray,
    small_writers: np.ndarray,
    small_bytes: int,
    inner_bytes: int,
) -> tuple[VarSpec, np.ndarray, dict[int, np.ndarray]]:
    assert h.dtype is not None and h.shape is not None
    shape, dtype = h.shape, h.dtype
    itemsize = dtypes.itemsize(dtype)
    total = h.nbytes
    if total <= small_bytes or len(part.offsets) == 0:
        # One plain chunk, assembled by one writer from the holders' boxes.
        full = (
            np.all(part.lengths == np.asarray(shape, dtype=np.int64), axis=1)
            if shape
            else (np.ones(len(part.offsets), dtype=bool))
        )
        holders_full = (
            h.ranks[np.isin(part.box_of, np.flatnonzero(full))] if len(part.offsets) else _NONE
        )
        candidates = holders_full if len(holders_full) else small_writers
        writer = int(candidates[np.lexsort((candidates, load[candidates]))[0]])
        load[writer] += total
        # Each distinct box from the writer if it holds it, else from its lowest holder
        # (holders are in rank order).
        held = part.box_of >= 0
        _, lowest = np.unique(part.box_of[held], return_index=True)
        src_rank = h.ranks[held][lowest]
        mine = np.flatnonzero((h.ranks == writer) & held)
        if len(mine):
            src_rank[part.box_of[mine[0]]] = writer
        sources = np.concatenate([src_rank[:, None], part.offsets, part.lengths], axis=1)
        spec = VarSpec(h.name, "tensor", path, dtype, shape, "small", choice=choice)
        return spec, np.array([writer], dtype=np.int64), {0: sources}
    nbytes = np.prod(part.lengths, axis=1) * itemsize
    if part.grid is not None:
        grid = part.grid
        counts = tuple(-(-n // c) for n, c in zip(shape, grid, strict=True))
        coords = part.offsets // np.asarray(grid, dtype=np.int64)
        linear = np.ravel_multi_index(tuple(coords.T), counts) if shape else np.zeros(1, np.int64)
        writers_by_box = _pick(load, h.ranks, part.box_of, nbytes)
        writers = np.empty(len(linear), dtype=np.int64)
        writers[linear] = writers_by_box
        spec = VarSpec(
            h.name,
            "tensor",
            path,
            dtype,
            shape,
            "regular",
            chunks=grid,
            inner=inner_chunks(grid, itemsize, inner_bytes),
            codec=codecs.make(choice, itemsize),
            choice=choice,
        )
        return spec, writers, {}
    boxes = part.boxes()  # sorted: np.unique orders them
    writers = _pick(load, h.ranks, part.box_of, nbytes)
    spec = VarSpec(h.name, "tensor", path, dtype, shape, "boxes", boxes=tuple(boxes), choice=choice)
    return spec, writers, {}


def _plan_per_rank(
    h: Holders, path: str, choice: str | None, load: np.ndarray
) -> tuple[VarSpec, np.ndarray, dict[int, np.ndarray]]:
    ranks: list[int] = []
    shapes: list[tuple[int, ...]] = []
    kinds: list[str] = []
    for r, (dtype, shape) in zip(h.ranks.tolist(), h.forms, strict=True):
        if dtype is None or shape is None:  # a per-rank value, stored in the index
            continue
        ranks.append(r)
        shapes.append(shape)
        kinds.append(dtype)
        load[r] += math.prod(shape) * dtypes.itemsize(dtype)
    spec = VarSpec(
        h.name,
        "per_rank",
        path,
        layout="per_rank",
        ranks=tuple(ranks),
        shapes=tuple(shapes),
        dtypes=tuple(kinds),
        choice=choice,
    )
    return spec, np.asarray(ranks, dtype=np.int64), {}


def _small_writers(
    planners: list[tuple[Holders, Partition | None]], world: int, small_bytes: int
) -> np.ndarray:
    """The ranks that write small tensors no single rank holds whole: evenly spread, one
    per :data:`SMALL_WRITER_BYTES` of them."""
    total = 0
    for h, part in planners:
        if h.kind != "tensor" or part is None or h.shape is None:
            continue
        n = h.nbytes
        if n > small_bytes:
            continue
        shape = np.asarray(h.shape, dtype=np.int64)
        if not np.any(np.all(part.lengths == shape, axis=1)):
            total += n
    count = min(world, max(1, -(-total // SMALL_WRITER_BYTES)))
    return np.asarray(sorted({i * world // count for i in range(count)}), dtype=np.int64)


def _groups(specs: list[VarSpec]) -> list[str]:
    """Every group node: the root, each ancestor of a variable, and the variables stored as
    groups of arrays."""
    groups = {""}
    for v in specs:
        if v.kind == "value":
            continue
        parts = v.path.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
        if v.layout in ("boxes", "per_rank"):
            groups.add(v.path)
    return sorted(groups)


def make_save_plan(
    descs_by_rank: Sequence[Sequence[Desc]],
    *,
    small_bytes: int = DEFAULT_SMALL_BYTES,
    inner_bytes: int = DEFAULT_INNER_BYTES,
    compression: Compression = None,
) -> SavePlan:
    """:func:`plan_save` over per-leaf descriptions (tests)."""
    return plan_save(
        [rank_desc(d) for d in descs_by_rank],
        small_bytes=small_bytes,
        inner_bytes=inner_bytes,
        compression=compression,
    )


class Balancer:
    """Picks, among the ranks that could write some bytes, the one with the least so far."""

    def __init__(self, world_size: int) -> None:
        self.load = [0] * world_size

    def pick(self, candidates: Sequence[int], nbytes: int) -> int:
        rank = min(candidates, key=lambda r: (self.load[r], r))
        self.load[rank] += nbytes
        return rank

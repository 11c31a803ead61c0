"""The save plan: validate every rank's description, then decide who writes what, where.

``make_save_plan`` runs on the coordinator over the descriptions gathered from every rank.
It is a pure function: tests feed it hand-built per-rank descriptions.

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
(:func:`distckpt.storage.codecs.choose`); plain chunks never are.

Identical boxes on several ranks are replicas: exactly one of them writes. Writers are
chosen greedily by bytes, largest first, so the work spreads over the ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distckpt import dtypes
from distckpt.errors import ValidationError
from distckpt.naming import zarr_path
from distckpt.planning.layout import find_overlap, inner_chunks, regular_grid
from distckpt.slices import Box
from distckpt.storage import codecs, zarr_meta
from distckpt.storage.codecs import Codec, Compression

DEFAULT_SMALL_BYTES = 256 * 1024
#: Inner chunk size: the unit of checksums and of reads. A resharded load reads the whole
#: inner chunks its boundaries cut, so smaller is better there; 1 MiB keeps that waste
#: small while shard indexes stay tiny (16 bytes per MiB).
DEFAULT_INNER_BYTES = 1024 * 1024
#: Bytes of gathered small tensors per writing rank: few writers keep the number of
#: gathers (one per writer) small, enough of them keep each writer's share of files small.
SMALL_WRITER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Desc:
    """What one rank holds of one variable (small: travels to the coordinator)."""

    name: str
    kind: str  # "tensor" | "value" | "per_rank"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    box: Box | None = None
    replicated: bool = False
    checksum: int | None = None  # of a replicated tensor's bytes
    value: Any = None  # encoded JSON of a value


@dataclass(frozen=True)
class Piece:
    """One file of the checkpoint and the rank that writes it."""

    id: int
    var: str
    dtype: str
    file: str  # relative to the checkpoint root
    box: Box  # global coordinates of the data it stores
    block: tuple[int, ...]  # stored block shape (>= box lengths at array edges)
    inner: tuple[int, ...] | None  # inner chunk shape; None for a plain chunk
    writer: int
    sources: tuple[tuple[int, Box], ...]  # (rank, box) whose data fill it
    meta_file: str | None = None  # a zarr.json the writer writes along with the piece
    meta: dict[str, Any] | None = None
    rank: int | None = None  # for per-rank pieces: whose data
    codec: Codec | None = None  # compresses each inner chunk (sharded pieces only)


@dataclass
class VarPlan:
    name: str
    kind: str
    path: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layout: str | None = None  # "regular" | "small" | "boxes" | "per_rank"
    value: Any = None
    per_rank_values: dict[int, Any] = field(default_factory=dict)
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class RankWork:
    """The part of a plan one rank acts on: the pieces it writes, and the boxes it sends to
    other writers (piece id, index in the piece's sources, writer, variable)."""

    token: str
    writes: list[Piece]
    sends: list[tuple[int, int, int, str]]
    exchange_writers: list[int]  # every rank takes part in one gather per writer, in order


@dataclass
class SavePlan:
    token: str
    world_size: int
    variables: list[VarPlan]
    groups: list[str]  # group nodes the coordinator writes zarr.json for ("" is the root)

    def work(self) -> list[RankWork]:
        """Every rank's :class:`RankWork`, in rank order (one pass over the plan)."""
        writers: set[int] = set()
        works = [RankWork(self.token, [], [], []) for _ in range(self.world_size)]
        for var in self.variables:
            for piece in var.pieces:
                works[piece.writer].writes.append(piece)
                for k, (rank, _box) in enumerate(piece.sources):
                    if rank != piece.writer:
                        writers.add(piece.writer)
                        works[rank].sends.append((piece.id, k, piece.writer, piece.var))
        for w in works:
            w.exchange_writers = sorted(writers)
        return works


def _fail(errors: list[str]) -> None:
    if errors:
        shown = errors[:10]
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ValidationError(
            "cannot save: the ranks' states are inconsistent:\n  " + "\n  ".join(shown) + more
        )


class Balancer:
    """Picks, among the ranks that could write some bytes, the one with the least so far."""

    def __init__(self, world_size: int) -> None:
        self.load = [0] * world_size

    def pick(self, candidates: Sequence[int], nbytes: int) -> int:
        rank = min(candidates, key=lambda r: (self.load[r], r))
        self.load[rank] += nbytes
        return rank


def make_save_plan(
    descs_by_rank: Sequence[Sequence[Desc]],
    token: str,
    *,
    small_bytes: int = DEFAULT_SMALL_BYTES,
    inner_bytes: int = DEFAULT_INNER_BYTES,
    compression: Compression = None,
) -> SavePlan:
    """Validate the descriptions of every rank and plan the writes (coordinator only).

    Raises :class:`ValidationError` naming every inconsistent variable and the ranks
    involved; nothing is written before this has passed.
    """
    world = len(descs_by_rank)
    codecs.check(compression)
    by_name = validate(descs_by_rank)
    balancer = Balancer(world)
    small_writers = _small_writers(by_name, world, small_bytes)
    variables: list[VarPlan] = []
    next_id = 0
    # Largest first, so the greedy balance spreads big tensors before small ones.
    order = sorted(by_name, key=lambda n: -_nbytes(by_name[n][0][1]))
    for name in order:
        held = by_name[name]
        first = held[0][1]
        var = VarPlan(name=name, kind=first.kind, path=zarr_path(name))
        choice = codecs.choose(compression, name)
        if first.kind == "value":
            var.value = first.value
        elif first.kind == "per_rank":
            var.layout = "per_rank"
            for rank, d in held:
                if d.dtype is None:
                    var.per_rank_values[rank] = d.value
                    continue
                assert d.shape is not None
                piece = _single_block_piece(
                    next_id,
                    name,
                    f"{var.path}/r{rank}",
                    d.dtype,
                    d.shape,
                    rank,
                    ((rank, Box.full(d.shape)),),
                    small_bytes,
                    inner_bytes,
                    choice,
                )
                var.pieces.append(dataclasses.replace(piece, rank=rank))
                balancer.load[rank] += _nbytes(d)
                next_id += 1
        else:
            var.dtype, var.shape = first.dtype, first.shape
            next_id = _plan_tensor(
                var,
                held,
                balancer,
                next_id,
                small_writers,
                small_bytes=small_bytes,
                inner_bytes=inner_bytes,
                choice=choice,
            )
        variables.append(var)
    variables.sort(key=lambda v: v.name)
    return SavePlan(token=token, world_size=world, variables=variables, groups=_groups(variables))


def validate(descs_by_rank: Sequence[Sequence[Desc]]) -> dict[str, list[tuple[int, Desc]]]:
    """Every variable's descriptions by rank, in order of first appearance, once they are
    consistent; else :class:`ValidationError` naming every inconsistent variable."""
    by_name: dict[str, list[tuple[int, Desc]]] = defaultdict(list)
    for rank, descs in enumerate(descs_by_rank):
        for d in descs:
            by_name[d.name].append((rank, d))
    errors: list[str] = []
    for name, held in by_name.items():
        errors.extend(_validate(name, held))
    _fail(errors)
    return by_name


def _nbytes(d: Desc) -> int:
    if d.dtype is None or d.shape is None:
        return 0
    return math.prod(d.shape) * dtypes.itemsize(d.dtype)


def _validate(name: str, held: list[tuple[int, Desc]]) -> list[str]:
    r0, d0 = held[0]
    for r, d in held[1:]:
        if d.kind != d0.kind:
            return [f"{name!r} is a {d0.kind} on rank {r0} but a {d.kind} on rank {r}"]
    if d0.kind == "per_rank":
        return []
    if d0.kind == "value":
        for r, d in held[1:]:
            if d.value != d0.value:
                return [
                    f"{name!r}: the value differs between rank {r0} ({d0.value!r}) and rank {r} "
                    f"({d.value!r}); wrap state that differs by rank in distckpt.PerRank"
                ]
        return []
    for r, d in held[1:]:
        if d.dtype != d0.dtype:
            return [f"{name!r}: dtype {d0.dtype} on rank {r0} but {d.dtype} on rank {r}"]
        if d.shape != d0.shape:
            return [
                f"{name!r}: global shape {list(d0.shape or ())} on rank {r0} but "
                f"{list(d.shape or ())} on rank {r}"
            ]
    replicas = [(r, d) for r, d in held if d.replicated]
    for r, d in replicas[1:]:
        if d.checksum != replicas[0][1].checksum:
            return [
                f"{name!r}: a plain tensor is saved as replicated but differs between rank "
                f"{replicas[0][0]} and rank {r}; use distckpt.Shard or a DTensor for partitioned "
                "values and distckpt.PerRank for per-rank state"
            ]
    shape = d0.shape or ()
    holders = owners(held)
    boxes = [b for b in holders if not b.empty]
    if regular_grid(shape, boxes) is not None or (not boxes and math.prod(shape) == 0):
        return []
    pair = find_overlap(boxes)
    if pair is not None:
        a, b = pair
        return [
            f"{name!r}: slices {a} (rank {holders[a][0]}) and {b} (rank {holders[b][0]}) "
            "overlap partially; ranks must hold identical or disjoint boxes"
        ]
    covered = sum(b.numel for b in boxes)
    total = math.prod(shape)
    if covered != total:
        return [
            f"{name!r}: the ranks' slices cover {covered} of the {total} elements of global "
            f"shape {list(shape)}; slices held: " + ", ".join(str(b) for b in sorted(boxes)[:8])
        ]
    return []


def owners(held: list[tuple[int, Desc]]) -> dict[Box, list[int]]:
    """Distinct boxes and the ranks holding each (replicas share a box)."""
    owners: dict[Box, list[int]] = defaultdict(list)
    for r, d in held:
        assert d.box is not None
        owners[d.box].append(r)
    return owners


def _small_writers(
    by_name: dict[str, list[tuple[int, Desc]]], world: int, small_bytes: int
) -> list[int]:
    """The ranks that write small tensors no single rank holds whole: evenly spread, one
    per :data:`SMALL_WRITER_BYTES` of them."""
    total = 0
    for held in by_name.values():
        d = held[0][1]
        n = _nbytes(d)
        if (
            d.kind == "tensor"
            and n <= small_bytes
            and not any(h.box == Box.full(h.shape or ()) for _, h in held)
        ):
            total += n
    count = min(world, max(1, -(-total // SMALL_WRITER_BYTES)))
    return sorted({i * world // count for i in range(count)})


def _plan_tensor(
    var: VarPlan,
    held: list[tuple[int, Desc]],
    balancer: Balancer,
    next_id: int,
    small_writers: list[int],
    *,
    small_bytes: int,
    inner_bytes: int,
    choice: str | None,
) -> int:
    assert var.dtype is not None and var.shape is not None
    shape, dtype = var.shape, var.dtype
    itemsize = dtypes.itemsize(dtype)
    held_by = {b: rs for b, rs in owners(held).items() if not b.empty}
    total = math.prod(shape) * itemsize
    if total <= small_bytes or not held_by:
        # One plain chunk, assembled by one writer from the holders' boxes.
        var.layout = "small"
        full = Box.full(shape)
        whole = [rs for b, rs in held_by.items() if b == full]
        writer = balancer.pick(whole[0] if whole else small_writers, total)
        sources = tuple(
            (writer if writer in rs else rs[0], box) for box, rs in sorted(held_by.items())
        )
        block = tuple(max(1, n) for n in shape)
        var.pieces.append(
            Piece(
                id=next_id,
                var=var.name,
                dtype=dtype,
                file=f"{var.path}/{zarr_meta.chunk_key([0] * len(shape))}",
                box=full,
                block=block,
                inner=None,
                writer=writer,
                sources=sources,
                meta_file=f"{var.path}/{zarr_meta.ZARR_JSON}",
                meta=zarr_meta.array_meta(shape, dtype, block, None),
            )
        )
        return next_id + 1
    boxes = sorted(held_by)
    grid = regular_grid(shape, boxes)
    if grid is not None:
        var.layout = "regular"
        inner = inner_chunks(grid, itemsize, inner_bytes)
        codec = codecs.make(choice, itemsize)
        meta = _meta(shape, dtype, grid, inner, codec)
        # Biggest boxes first for the balance; the first piece's writer writes zarr.json.
        for i, box in enumerate(sorted(boxes, key=lambda b: (-b.numel, b))):
            writer = balancer.pick(held_by[box], box.numel * itemsize)
            coord = tuple(o // c for o, c in zip(box.offsets, grid, strict=True))
            var.pieces.append(
                Piece(
                    id=next_id,
                    var=var.name,
                    dtype=dtype,
                    file=f"{var.path}/{zarr_meta.chunk_key(coord)}",
                    box=box,
                    block=grid,
                    inner=inner,
                    writer=writer,
                    sources=((writer, box),),
                    meta_file=f"{var.path}/{zarr_meta.ZARR_JSON}" if i == 0 else None,
                    meta=meta if i == 0 else None,
                    codec=codec,
                )
            )
            next_id += 1
        return next_id
    var.layout = "boxes"
    for k, box in enumerate(boxes):
        writer = balancer.pick(held_by[box], box.numel * itemsize)
        var.pieces.append(
            _single_block_piece(
                next_id,
                var.name,
                f"{var.path}/p{k}",
                dtype,
                box.lengths,
                writer,
                ((writer, box),),
                small_bytes,
                inner_bytes,
                choice,
                box=box,
            )
        )
        next_id += 1
    return next_id


def _single_block_piece(
    piece_id: int,
    name: str,
    path: str,
    dtype: str,
    shape: tuple[int, ...],
    writer: int,
    sources: tuple[tuple[int, Box], ...],
    small_bytes: int,
    inner_bytes: int,
    choice: str | None,
    box: Box | None = None,
) -> Piece:
    """A piece that is a whole array of its own (one box of an irregular partition, or
    one rank's per-rank tensor)."""
    itemsize = dtypes.itemsize(dtype)
    block = tuple(max(1, n) for n in shape)
    small = math.prod(shape) * itemsize <= small_bytes or not shape
    inner = None if small else inner_chunks(block, itemsize, inner_bytes)
    codec = None if small else codecs.make(choice, itemsize)
    return Piece(
        id=piece_id,
        var=name,
        dtype=dtype,
        file=f"{path}/{zarr_meta.chunk_key([0] * len(shape))}",
        box=box or Box.full(shape),
        block=block,
        inner=inner,
        writer=writer,
        sources=sources,
        meta_file=f"{path}/{zarr_meta.ZARR_JSON}",
        meta=_meta(shape, dtype, block, inner, codec),
        codec=codec,
    )


def _meta(
    shape: Sequence[int],
    dtype: str,
    chunks: Sequence[int],
    inner: Sequence[int] | None,
    codec: Codec | None,
) -> dict[str, Any]:
    compressor = None if codec is None else codec.to_json()
    return zarr_meta.array_meta(shape, dtype, chunks, inner, compressor=compressor)


def _groups(variables: list[VarPlan]) -> list[str]:
    """Every group node: the root, each ancestor of a variable, and the variables stored as
    groups of arrays."""
    groups = {""}
    for v in variables:
        if v.kind == "value":
            continue
        parts = v.path.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
        if v.layout in ("boxes", "per_rank"):
            groups.add(v.path)
    return sorted(groups)

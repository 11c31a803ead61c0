"""The save plan: validate every rank's description, then decide who writes what, where.

:func:`plan_save` runs on the coordinator over the descriptions gathered from every rank
(:class:`RankDesc`). It is a pure function: tests and the scale benchmark feed it
synthetic descriptions of thousands of ranks.

Descriptions are columnar, because a job of thousands of ranks holding a thousand
variables each would otherwise be millions of Python objects on the coordinator: a rank
sends its :class:`Schema` (names, kinds, dtypes, shapes: identical on every rank of an
SPMD job, so sent once per distinct schema) and one integer vector of its boxes. The
planner works per variable on arrays over the ranks holding it.

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
chosen greedily by bytes, largest variable first, so the work spreads over the ranks.

The plan is what every rank needs: the variables' specs (:class:`VarSpec`, the same for
every rank: broadcast) and each rank's :class:`Share` (the pieces it writes and the boxes
it sends: scattered), which the rank expands into its :class:`RankWork`. Piece ``k`` of a
variable has the id ``spec.first + k``; the pieces of a regular array are numbered in C
order of their grid coordinates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.errors import ValidationError
from distckpt.naming import zarr_path
from distckpt.planning.layout import find_overlap, inner_chunks
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
    """What one rank holds of one variable (the engine's per-leaf description)."""

    name: str
    kind: str  # "tensor" | "value" | "per_rank"
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    box: Box | None = None
    replicated: bool = False
    checksum: int | None = None  # of a replicated tensor's bytes
    value: Any = None  # encoded JSON of a value


class Schema:
    """The leaves one rank holds, without their boxes or contents: names, kinds, dtypes,
    global shapes and which tensors are replicated. Ranks of an SPMD job share one."""

    __slots__ = ("entries", "digest", "slots", "width")

    def __init__(
        self, entries: Sequence[tuple[str, str, str | None, tuple[int, ...] | None, bool]]
    ) -> None:
        self.entries = tuple(entries)
        self.digest = hashlib.blake2b(repr(self.entries).encode(), digest_size=16).digest()
        # Each "tensor" leaf's box takes 2 * ndim integers of the rank's box vector.
        slots: list[int | None] = []
        width = 0
        for _name, kind, _dtype, shape, _rep in self.entries:
            if kind == "tensor" and shape is not None:
                slots.append(width)
                width += 2 * len(shape)
            else:
                slots.append(None)
        self.slots = tuple(slots)
        self.width = width

    def __reduce__(self) -> tuple[Any, ...]:
        return (Schema, (self.entries,))

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class RankDesc:
    """One rank's description: its schema (None where the coordinator's is the same), the
    boxes of its tensor leaves (offsets then lengths, in schema order), its values (by
    name, encoded) and the crc32c of those replicated tensors it was asked to check."""

    schema: Schema | None
    digest: bytes
    boxes: np.ndarray
    values: dict[str, Any] = field(default_factory=dict)
    checksums: dict[str, int] = field(default_factory=dict)


def rank_desc(descs: Sequence[Desc]) -> RankDesc:
    """The columnar description of one rank's per-leaf descriptions."""
    schema = Schema([(d.name, d.kind, d.dtype, d.shape, d.replicated) for d in descs])
    boxes = np.zeros(schema.width, dtype=np.int64)
    values: dict[str, Any] = {}
    checksums: dict[str, int] = {}
    for d, slot in zip(descs, schema.slots, strict=True):
        if slot is not None:
            assert d.box is not None
            n = d.box.ndim
            boxes[slot : slot + n] = d.box.offsets
            boxes[slot + n : slot + 2 * n] = d.box.lengths
        if d.dtype is None:
            values[d.name] = d.value
        if d.checksum is not None:
            checksums[d.name] = d.checksum
    return RankDesc(schema, schema.digest, boxes, values, checksums)


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


@dataclass(frozen=True)
class VarSpec:
    """One variable of the plan, as every rank sees it.

    ``layout`` "regular": one array of ``chunks``-shaped shards, piece ``k`` the shard at
    the ``k``-th grid coordinate in C order; "small": one plain chunk; "boxes": one array
    per box of ``boxes``; "per_rank": one array per rank of ``ranks``, of ``shapes``.
    """

    name: str
    kind: str  # "tensor" | "value" | "per_rank"
    path: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layout: str | None = None  # "regular" | "small" | "boxes" | "per_rank"; None: a value
    first: int = 0  # the id of piece 0
    count: int = 0  # pieces
    chunks: tuple[int, ...] | None = None  # regular: the shard shape
    inner: tuple[int, ...] | None = None  # regular: the inner chunk shape
    codec: Codec | None = None  # regular: the codec of every shard
    boxes: tuple[Box, ...] = ()  # boxes: one per piece
    ranks: tuple[int, ...] = ()  # per_rank: the rank of each piece
    shapes: tuple[tuple[int, ...], ...] = ()  # per_rank: the shape of each piece
    dtypes: tuple[str, ...] = ()  # per_rank: the dtype of each piece
    choice: str | None = None  # the compression chosen for this name

    def grid(self) -> tuple[int, ...]:
        """Shards per dimension of a regular array."""
        assert self.shape is not None and self.chunks is not None
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunks, strict=True))

    def box_of(self, k: int) -> Box:
        """The global box piece ``k`` stores."""
        if self.layout == "regular":
            assert self.shape is not None and self.chunks is not None
            coord = np.unravel_index(k, self.grid()) if self.shape else ()
            offsets = tuple(int(c) * n for c, n in zip(coord, self.chunks, strict=True))
            lengths = tuple(
                min(n, s - o) for o, n, s in zip(offsets, self.chunks, self.shape, strict=True)
            )
            return Box(offsets, lengths)
        if self.layout == "boxes":
            return self.boxes[k]
        if self.layout == "per_rank":
            return Box.full(self.shapes[k])
        assert self.shape is not None
        return Box.full(self.shape)

    def piece(
        self,
        k: int,
        writer: int,
        sources: tuple[tuple[int, Box], ...] | None = None,
        small_bytes: int = DEFAULT_SMALL_BYTES,
        inner_bytes: int = DEFAULT_INNER_BYTES,
    ) -> Piece:
        """Piece ``k``, written by ``writer`` from ``sources`` (default: its own box),
        with the ``zarr.json`` it writes along with it (the first piece of a regular
        array, every piece of the other layouts)."""
        box = self.box_of(k)
        src = sources if sources is not None else ((writer, box),)
        pid = self.first + k
        if self.layout == "per_rank":  # each rank's tensor has its own dtype and shape
            dtype = self.dtypes[k]
        else:
            assert self.dtype is not None and self.shape is not None
            dtype = self.dtype
        if self.layout == "regular":
            assert self.chunks is not None and self.shape is not None
            coord = np.unravel_index(k, self.grid()) if self.shape else ()
            meta = None
            if k == 0:
                meta = _meta(self.shape, dtype, self.chunks, self.inner, self.codec)
            return Piece(
                pid,
                self.name,
                dtype,
                f"{self.path}/{zarr_meta.chunk_key([int(c) for c in coord])}",
                box,
                self.chunks,
                self.inner,
                writer,
                src,
                meta_file=f"{self.path}/{zarr_meta.ZARR_JSON}" if k == 0 else None,
                meta=meta,
                codec=self.codec,
            )
        if self.layout == "small":
            assert self.shape is not None
            block = tuple(max(1, n) for n in self.shape)
            return Piece(
                pid,
                self.name,
                dtype,
                f"{self.path}/{zarr_meta.chunk_key([0] * len(self.shape))}",
                box,
                block,
                None,
                writer,
                src,
                meta_file=f"{self.path}/{zarr_meta.ZARR_JSON}",
                meta=zarr_meta.array_meta(self.shape, dtype, block, None),
            )
        sub = f"{self.path}/p{k}" if self.layout == "boxes" else f"{self.path}/r{self.ranks[k]}"
        itemsize = dtypes.itemsize(dtype)
        lengths = box.lengths
        block = tuple(max(1, n) for n in lengths)
        small = math.prod(lengths) * itemsize <= small_bytes or not lengths
        inner = None if small else inner_chunks(block, itemsize, inner_bytes)
        codec = None if small else codecs.make(self.choice, itemsize)
        return Piece(
            pid,
            self.name,
            dtype,
            f"{sub}/{zarr_meta.chunk_key([0] * len(lengths))}",
            box,
            block,
            inner,
            writer,
            src,
            meta_file=f"{sub}/{zarr_meta.ZARR_JSON}",
            meta=_meta(lengths, dtype, block, inner, codec),
            rank=self.ranks[k] if self.layout == "per_rank" else None,
            codec=codec,
        )


@dataclass
class Share:
    """What one rank is told to do: the ids of the pieces it writes, the sources of those
    it assembles from other ranks' boxes (rows of rank, offsets, lengths), and the boxes
    it sends (rows of piece id, index in the piece's sources, writer)."""

    writes: np.ndarray
    sources: dict[int, np.ndarray] = field(default_factory=dict)
    sends: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))


def source_boxes(rows: np.ndarray) -> tuple[tuple[int, Box], ...]:
    """A piece's sources, ``(rank, box)``, from their rows (rank, offsets, lengths)."""
    d = (rows.shape[1] - 1) // 2
    return tuple((row[0], Box(tuple(row[1 : 1 + d]), tuple(row[1 + d :]))) for row in rows.tolist())


@dataclass
class Shared:
    """The part of a plan every rank receives (broadcast once per plan)."""

    specs: list[VarSpec]
    exchange_writers: list[int]  # every rank takes part in one gather per writer, in order
    small_bytes: int
    inner_bytes: int

    def expand(self, share: Share, rank: int, token: str) -> RankWork:
        """This rank's work, from its share."""
        firsts = [s.first for s in self.specs]
        writes: list[Piece] = []
        for pid in share.writes.tolist():
            spec = self.specs[bisect_right(firsts, pid) - 1]
            rows = share.sources.get(pid)
            writes.append(
                spec.piece(
                    pid - spec.first,
                    rank,
                    None if rows is None else source_boxes(rows),
                    self.small_bytes,
                    self.inner_bytes,
                )
            )
        sends = [
            (pid, k, writer, self.specs[bisect_right(firsts, pid) - 1].name)
            for pid, k, writer in share.sends.tolist()
        ]
        return RankWork(token, writes, sends, list(self.exchange_writers))


@dataclass
class RankWork:
    """The part of a plan one rank acts on: the pieces it writes, and the boxes it sends to
    other writers (piece id, index in the piece's sources, writer, variable)."""

    token: str
    writes: list[Piece]
    sends: list[tuple[int, int, int, str]]
    exchange_writers: list[int]


@dataclass
class SavePlan:
    """The coordinator's plan: every variable's spec and every piece's writer."""

    world_size: int
    shared: Shared
    writers: np.ndarray  # by piece id
    sources: dict[int, np.ndarray]  # of the pieces assembled from boxes: rank, offsets, lengths
    groups: list[str]  # group nodes the coordinator writes zarr.json for ("" is the root)

    @property
    def specs(self) -> list[VarSpec]:
        return self.shared.specs

    @property
    def pieces(self) -> int:
        return len(self.writers)

    def variable(self, name: str) -> VarSpec:
        return next(s for s in self.specs if s.name == name)

    def pieces_of(self, spec: VarSpec, *, sources: bool = True) -> list[Piece]:
        """Every piece of one variable (tests and the index; a rank expands its own),
        with the boxes its writer assembles it from unless ``sources`` is false."""
        out = []
        for k in range(spec.count):
            rows = self.sources.get(spec.first + k) if sources else None
            out.append(
                spec.piece(
                    k,
                    int(self.writers[spec.first + k]),
                    None if rows is None else source_boxes(rows),
                    self.shared.small_bytes,
                    self.shared.inner_bytes,
                )
            )
        return out

    def shares(self) -> list[Share]:
        """Every rank's :class:`Share`, in rank order."""
        order = np.argsort(self.writers, kind="stable")
        bounds = np.searchsorted(self.writers[order], np.arange(self.world_size + 1))
        shares = [Share(order[bounds[r] : bounds[r + 1]]) for r in range(self.world_size)]
        sends: list[np.ndarray] = []  # rows: sending rank, piece id, index, writer
        for pid, rows in self.sources.items():
            writer = int(self.writers[pid])
            shares[writer].sources[pid] = rows
            ranks = rows[:, 0]
            k = np.flatnonzero(ranks != writer)
            sends.append(
                np.stack([ranks[k], np.full(len(k), pid), k, np.full(len(k), writer)], axis=1)
            )
        if sends:
            table = np.concatenate(sends)
            table = table[np.argsort(table[:, 0], kind="stable")]
            cuts = np.searchsorted(table[:, 0], np.arange(self.world_size + 1))
            for r in range(self.world_size):
                if cuts[r + 1] > cuts[r]:
                    shares[r].sends = table[cuts[r] : cuts[r + 1], 1:]
        return shares

    def work(self, token: str = "t") -> list[RankWork]:
        """Every rank's :class:`RankWork`, in rank order (tests)."""
        return [self.shared.expand(s, r, token) for r, s in enumerate(self.shares())]


def raise_inconsistent(errors: list[str]) -> None:
    """Raise :class:`ValidationError` listing ``errors`` (the first ten), if any."""
    if errors:
        shown = errors[:10]
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ValidationError(
            "cannot save: the ranks' states are inconsistent:\n  " + "\n  ".join(shown) + more
        )


@dataclass
class Holders:
    """Every rank holding one variable, as arrays: ranks ``(n,)``, offsets and lengths
    ``(n, ndim)`` of their boxes (tensors), in rank order."""

    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    ranks: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    replicated: np.ndarray  # bool per holder
    forms: list[tuple[str | None, tuple[int, ...] | None]]  # per holder of a per-rank
    # variable: its dtype and shape (None, None: a per-rank value)

    @property
    def nbytes(self) -> int:
        if self.dtype is None or self.shape is None:
            return 0
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def survey(ranks: Sequence[RankDesc]) -> tuple[dict[str, Holders], list[str]]:
    """Every variable's :class:`Holders` (by name, in order of first appearance) and the
    inconsistencies found between ranks. Every ``schema`` must be set."""
    groups: dict[bytes, tuple[Schema, list[int]]] = {}
    for r, desc in enumerate(ranks):
        assert desc.schema is not None, "survey needs every rank's schema"
        groups.setdefault(desc.digest, (desc.schema, []))[1].append(r)
    # name -> [(schema, leaf index, ranks, box matrix)]
    parts: dict[str, list[tuple[Schema, int, np.ndarray, np.ndarray | None]]] = defaultdict(list)
    for schema, members in groups.values():
        rank_ids = np.asarray(members, dtype=np.int64)
        # (ranks, slots), stored a slot at a time: a variable's columns are contiguous.
        matrix = (
            np.stack([ranks[r].boxes for r in members], axis=1).T
            if schema.width
            else np.zeros((len(members), 0), dtype=np.int64)
        )
        for i, (name, *_rest) in enumerate(schema.entries):
            parts[name].append((schema, i, rank_ids, matrix))
    holders: dict[str, Holders] = {}
    errors: list[str] = []
    for name, found in parts.items():
        found.sort(key=lambda p: int(p[2][0]))  # the group of the lowest rank first
        error = _consistent(name, found)
        if error is not None:
            errors.append(error)
            continue
        schema, i, _, _ = found[0]
        _, kind, dtype, shape, _ = schema.entries[i]
        rank_parts: list[np.ndarray] = []
        offs: list[np.ndarray] = []
        lens: list[np.ndarray] = []
        reps: list[np.ndarray] = []
        forms: list[tuple[str | None, tuple[int, ...] | None]] = []
        for sch, j, group_ranks, box_matrix in found:
            rank_parts.append(group_ranks)
            slot = sch.slots[j]
            entry_shape = sch.entries[j][3]
            if slot is not None and box_matrix is not None and entry_shape is not None:
                d = len(entry_shape)
                offs.append(box_matrix[:, slot : slot + d])
                lens.append(box_matrix[:, slot + d : slot + 2 * d])
            reps.append(np.full(len(group_ranks), sch.entries[j][4]))
            if kind == "per_rank":  # each rank's own dtype and shape (None: a value)
                forms.extend([(sch.entries[j][2], entry_shape)] * len(group_ranks))
        ndim = len(shape) if shape is not None else 0
        all_ranks = np.concatenate(rank_parts) if len(rank_parts) > 1 else rank_parts[0]
        empty = np.zeros((len(all_ranks), ndim), dtype=np.int64)
        h = Holders(
            name,
            kind,
            dtype,
            shape,
            all_ranks,
            np.concatenate(offs) if len(offs) > 1 else (offs[0] if offs else empty),
            np.concatenate(lens) if len(lens) > 1 else (lens[0] if lens else empty),
            np.concatenate(reps) if len(reps) > 1 else reps[0],
            forms,
        )
        if len(rank_parts) > 1:  # in rank order
            order = np.argsort(all_ranks, kind="stable")
            h.ranks, h.offsets = all_ranks[order], h.offsets[order]
            h.lengths = h.lengths[order]
            h.replicated = h.replicated[order]
            h.forms = [forms[k] for k in order.tolist()] if forms else []
        holders[name] = h
    return holders, errors


def _consistent(
    name: str, found: list[tuple[Schema, int, np.ndarray, np.ndarray | None]]
) -> str | None:
    """The first inconsistency of kind, dtype or shape between the groups holding
    ``name`` (reported as the lowest rank of each side), or None."""
    schema0, i0, ranks0, _ = found[0]
    _, kind0, dtype0, shape0, _ = schema0.entries[i0]
    r0 = int(ranks0[0])
    differing: list[tuple[int, str]] = []
    for schema, i, members, _ in found[1:]:
        _, kind, dtype, shape, _ = schema.entries[i]
        r = int(members[0])
        if kind != kind0:
            differing.append((r, f"{name!r} is a {kind0} on rank {r0} but a {kind} on rank {r}"))
        elif kind0 == "per_rank" or kind0 == "value":
            continue
        elif dtype != dtype0:
            differing.append((r, f"{name!r}: dtype {dtype0} on rank {r0} but {dtype} on rank {r}"))
        elif shape != shape0:
            differing.append(
                (
                    r,
                    f"{name!r}: global shape {list(shape0 or ())} on rank {r0} but "
                    f"{list(shape or ())} on rank {r}",
                )
            )
    return min(differing)[1] if differing else None


def check_contents(kinds: dict[str, str], ranks: Sequence[RankDesc]) -> list[str]:
    """The values that differ between the ranks holding them, and the replicated tensors
    whose checksums differ (of those checked on more than one rank)."""
    values = (
        (r, name, value)
        for r, desc in enumerate(ranks)
        for name, value in desc.values.items()
        if kinds.get(name) == "value"
    )
    crcs = ((r, name, crc) for r, desc in enumerate(ranks) for name, crc in desc.checksums.items())
    return [
        *(
            f"{name!r}: the value differs between rank {r0} ({v0!r}) and rank {r} ({v!r}); "
            "wrap state that differs by rank in distckpt.PerRank"
            for name, r0, v0, r, v in _differences(values)
        ),
        *(
            f"{name!r}: a plain tensor is saved as replicated but differs between rank {r0} "
            f"and rank {r}; use distckpt.Shard or a DTensor for partitioned values and "
            "distckpt.PerRank for per-rank state"
            for name, r0, _, r, _ in _differences(crcs)
        ),
    ]


def _differences(
    held: Iterable[tuple[int, str, Any]],
) -> Iterator[tuple[str, int, Any, int, Any]]:
    """For each name, the first rank whose item differs from the first rank's: (name,
    first rank, its item, that rank, its item)."""
    firsts: dict[str, tuple[int, Any]] = {}
    reported: set[str] = set()
    for r, name, item in held:
        r0, first = firsts.setdefault(name, (r, item))
        if first != item and name not in reported:
            reported.add(name)
            yield name, r0, first, r, item


def checked(ranks: Sequence[RankDesc]) -> list[tuple[Holders, _Partition | None]]:
    """Every variable's holders and, for a tensor, its partition, once every rank's
    description is consistent; else :class:`ValidationError` naming every inconsistency."""
    holders, errors = survey(ranks)
    errors += check_contents({n: h.kind for n, h in holders.items()}, ranks)
    out: list[tuple[Holders, _Partition | None]] = []
    for h in holders.values():
        part = _Partition.of(h) if h.kind == "tensor" else None
        if part is not None and part.error is not None:
            errors.append(part.error)
        out.append((h, part))
    raise_inconsistent(errors)
    return out


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


_NONE = np.zeros(0, dtype=np.int64)


def _with_first(spec: VarSpec, first: int, count: int) -> VarSpec:
    return dataclasses.replace(spec, first=first, count=count)


@dataclass
class _Partition:
    """A tensor's distinct non-empty boxes (``offsets``, ``lengths``: ``(m, ndim)``), which
    holder holds which (``box_of``: per holder, -1 for an empty box), and its layout."""

    offsets: np.ndarray
    lengths: np.ndarray
    box_of: np.ndarray
    grid: tuple[int, ...] | None
    error: str | None = None

    @classmethod
    def of(cls, h: Holders) -> _Partition:
        assert h.shape is not None
        shape = h.shape
        ndim = len(shape)
        nonempty = np.all(h.lengths > 0, axis=1) if ndim else np.ones(len(h.ranks), dtype=bool)
        keys = np.concatenate([h.offsets, h.lengths], axis=1)[nonempty]
        distinct, inverse = _distinct_rows(keys)
        box_of = np.full(len(h.ranks), -1, dtype=np.int64)
        box_of[nonempty] = inverse
        offsets, lengths = distinct[:, :ndim], distinct[:, ndim:]
        part = cls(offsets, lengths, box_of, _regular_grid(shape, offsets, lengths))
        if part.grid is None and h.nbytes:  # (no box at all: nothing covered)
            part.error = part._irregular_error(h)
        return part

    def boxes(self) -> list[Box]:
        return [
            Box(tuple(o), tuple(n))
            for o, n in zip(self.offsets.tolist(), self.lengths.tolist(), strict=True)
        ]

    def _irregular_error(self, h: Holders) -> str | None:
        """For a partition that is not a regular grid: partial overlaps, or a gap."""
        assert h.shape is not None
        boxes = self.boxes()
        first_holder: dict[Box, int] = {}
        for k, b in enumerate(self.box_of.tolist()):
            if b >= 0:
                first_holder.setdefault(boxes[b], int(h.ranks[k]))
        pair = find_overlap(boxes)
        if pair is not None:
            a, b = pair
            return (
                f"{h.name!r}: slices {a} (rank {first_holder[a]}) and {b} (rank "
                f"{first_holder[b]}) overlap partially; ranks must hold identical or disjoint boxes"
            )
        covered = sum(b.numel for b in boxes)
        total = math.prod(h.shape)
        if covered != total:
            return (
                f"{h.name!r}: the ranks' slices cover {covered} of the {total} elements of global "
                f"shape {list(h.shape)}; slices held: " + ", ".join(str(b) for b in boxes[:8])
            )
        return None


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a non-negative integer matrix, in lexicographic order, and each
    row's index among them. Rows whose columns fit 62 bits together are packed into one
    integer each and sorted as such; others are sorted column by column."""
    if len(rows) == 0:
        return rows, _NONE
    if rows.shape[1] == 0:
        return rows[:1], np.zeros(len(rows), dtype=np.int64)
    bits = [int(top).bit_length() for top in rows.max(axis=0).tolist()]
    if sum(bits) <= 62:
        key = rows[:, 0].copy()
        for j in range(1, rows.shape[1]):
            key <<= bits[j]
            key |= rows[:, j]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return rows[first], inverse.reshape(-1)
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    inverse = np.empty(len(rows), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _regular_grid(
    shape: tuple[int, ...], offsets: np.ndarray, lengths: np.ndarray
) -> tuple[int, ...] | None:
    """The shard shape if the distinct boxes tile ``shape`` as a regular grid (per
    dimension equal pieces, the last possibly shorter, as ``torch.chunk`` and DTensor
    split), else None. See :func:`distckpt.planning.layout.regular_grid`."""
    m = len(offsets)
    if m == 0:
        return None
    chunk: list[int] = []
    count = 1
    for d, n in enumerate(shape):
        starts, sizes = offsets[:, d], lengths[:, d]
        if starts.max() == 0 and sizes.min() == n:  # not split along this dimension
            chunk.append(n)
            continue
        pairs, _ = _distinct_rows(np.stack([starts, sizes], axis=1))
        starts, sizes = pairs[:, 0], pairs[:, 1]
        size = int(sizes[0])
        ends = starts + sizes
        if (
            starts[0] != 0
            or np.any(starts[1:] != ends[:-1])
            or np.any(sizes[:-1] != size)
            or sizes[-1] > size
            or ends[-1] != n
        ):
            return None
        chunk.append(size)
        count *= len(pairs)
    return tuple(chunk) if count == m else None


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
    part: _Partition,
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
    planners: list[tuple[Holders, _Partition | None]], world: int, small_bytes: int
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


def _meta(
    shape: Sequence[int],
    dtype: str,
    chunks: Sequence[int],
    inner: Sequence[int] | None,
    codec: Codec | None,
) -> dict[str, Any]:
    compressor = None if codec is None else codec.to_json()
    return zarr_meta.array_meta(shape, dtype, chunks, inner, compressor=compressor)


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


# The per-leaf validation the Hugging Face export shares (it plans files, not arrays).


def validate(descs_by_rank: Sequence[Sequence[Desc]]) -> dict[str, list[tuple[int, Desc]]]:
    """Every variable's descriptions by rank, in order of first appearance, once they are
    consistent; else :class:`ValidationError` naming every inconsistent variable."""
    checked([rank_desc(d) for d in descs_by_rank])
    by_name: dict[str, list[tuple[int, Desc]]] = defaultdict(list)
    for rank, descs in enumerate(descs_by_rank):
        for d in descs:
            by_name[d.name].append((rank, d))
    return by_name


def owners(held: list[tuple[int, Desc]]) -> dict[Box, list[int]]:
    """Distinct boxes and the ranks holding each (replicas share a box)."""
    found: dict[Box, list[int]] = defaultdict(list)
    for r, d in held:
        assert d.box is not None
        found[d.box].append(r)
    return found


class Balancer:
    """Picks, among the ranks that could write some bytes, the one with the least so far."""

    def __init__(self, world_size: int) -> None:
        self.load = [0] * world_size

    def pick(self, candidates: Sequence[int], nbytes: int) -> int:
        rank = min(candidates, key=lambda r: (self.load[r], r))
        self.load[rank] += nbytes
        return rank

"""The save plan's data: the pieces (files) of a checkpoint, each variable's spec, and
what each rank is told to do. Pure data, no I/O.

The plan is what every rank needs: the variables' specs (:class:`VarSpec`, the same for
every rank: broadcast) and each rank's :class:`Share` (the pieces it writes and the boxes
it sends: scattered), which the rank expands into its :class:`RankWork`. Piece ``k`` of a
variable has the id ``spec.first + k``; the pieces of a regular array are numbered in C
order of their grid coordinates.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.format import codecs, zarr_meta
from distckpt.format.codecs import Codec
from distckpt.planning.layout import inner_chunks
from distckpt.slices import Box

DEFAULT_SMALL_BYTES = 256 * 1024

#: Inner chunk size: the unit of checksums and of reads. A resharded load reads the whole
#: inner chunks its boundaries cut, so smaller is better there; 1 MiB keeps that waste
#: small while shard indexes stay tiny (16 bytes per MiB).
DEFAULT_INNER_BYTES = 1024 * 1024


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


def _meta(
    shape: Sequence[int],
    dtype: str,
    chunks: Sequence[int],
    inner: Sequence[int] | None,
    codec: Codec | None,
) -> dict[str, Any]:
    compressor = None if codec is None else codec.to_json()
    return zarr_meta.array_meta(shape, dtype, chunks, inner, compressor=compressor)

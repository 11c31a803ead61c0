"""The commit of one save: the group metadata and the index.

Runs on the coordinator once every rank reported its pieces durable. The index is the root
group's ``zarr.json`` attribute ``distckpt`` (see :mod:`distckpt.format.index`); nothing
is a checkpoint under the final name before the transaction commits it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt.commit.transaction import Transaction
from distckpt.errors import CheckpointError
from distckpt.format import seal, zarr_meta
from distckpt.format.digests import ALGORITHM, PIECE_BYTES
from distckpt.format.index import (
    ATTRIBUTE,
    FORMAT,
    FORMAT_VERSION,
    FORMAT_VERSION_COMPRESSED,
    FORMAT_VERSION_REGULAR,
    FORMAT_VERSION_UNCOMPRESSED,
)
from distckpt.format.shard_io import Stored
from distckpt.format.stored import StoredPiece, regular_entry, reuse_column
from distckpt.planning.pieces import SavePlan, VarSpec
from distckpt.values import has_binary
from distckpt.version import VERSION


@dataclass
class Report:
    """What one rank stored: the ids of its pieces, each one's stored bytes and crc, its
    content digest (rows of 16 bytes; None when the save computed none) and, for a piece
    taken from an earlier checkpoint instead of written, where from (``reused``: an index
    into ``origins``, -1 for a piece written)."""

    ids: np.ndarray
    sizes: np.ndarray
    crcs: np.ndarray
    digests: np.ndarray | None = None
    reused: np.ndarray | None = None
    origins: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, written: dict[int, Stored]) -> Report:
        n = len(written)
        stored = list(written.values())
        ids = np.fromiter(written, dtype=np.int64, count=n)
        sizes = np.fromiter((s.size for s in stored), dtype=np.int64, count=n)
        crcs = np.fromiter((s.crc for s in stored), dtype=np.int64, count=n)
        digests = None
        if n and all(s.digest is not None for s in stored):
            raw = b"".join(s.digest for s in stored)  # type: ignore[misc]
            digests = np.frombuffer(raw, dtype=np.uint8).reshape(n, PIECE_BYTES)
        origins = sorted({s.reused for s in stored if s.reused is not None})
        reused = None
        if origins:
            at = {o: k for k, o in enumerate(origins)}
            reused = np.fromiter(
                (-1 if s.reused is None else at[s.reused] for s in stored), np.int16, count=n
            )
        return cls(ids, sizes, crcs, digests, reused, origins)

    @property
    def nbytes(self) -> int:
        """Bytes of every piece, written or reused."""
        return int(self.sizes.sum())

    @property
    def reused_bytes(self) -> int:
        """Bytes of the pieces taken from an earlier checkpoint."""
        return 0 if self.reused is None else int(self.sizes[self.reused >= 0].sum())


def _tensor_entry(
    dtype: str, shape: tuple[int, ...], path: str, layout: str, pieces: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "kind": "tensor",
        "dtype": dtype,
        "shape": list(shape),
        "path": path,
        "layout": layout,
        "pieces": pieces,
    }


def _stored_values(variables: dict[str, Any]) -> list[Any]:
    """Every stored value of an index's ``variables`` (per-rank ones included)."""
    entries = [e for v in variables.values() for e in [v, *v.get("ranks", {}).values()]]
    return [e["value"] for e in entries if e.get("kind") == "value"]


def build_index(
    plan: SavePlan, reports: Sequence[Report], values: dict[str, Any]
) -> dict[str, Any]:
    """The index of a save from its plan, every rank's report and its values (by name; a
    per-rank variable's by rank)."""
    sizes = np.full(plan.pieces, -1, dtype=np.int64)
    crcs = np.zeros(plan.pieces, dtype=np.int64)
    # Digests only when every rank computed them (an incremental save's).
    digests: np.ndarray | None = np.zeros((plan.pieces, PIECE_BYTES), np.uint8)
    origins: list[str] = []  # of the pieces reused, across the ranks
    reused = np.full(plan.pieces, -1, dtype=np.int16)
    for report in reports:
        sizes[report.ids] = report.sizes
        crcs[report.ids] = report.crcs
        if report.digests is None or digests is None:
            digests = None if len(report.ids) else digests
        else:
            digests[report.ids] = report.digests
        if report.reused is not None:
            for k, origin in enumerate(report.origins):
                if origin not in origins:
                    origins.append(origin)
                reused[report.ids[report.reused == k]] = origins.index(origin)
    if plan.pieces and sizes.min() < 0:
        missing = int(np.flatnonzero(sizes < 0)[0])
        raise CheckpointError(f"internal error: no rank reported piece {missing} as written")

    def listed(spec: VarSpec) -> list[dict[str, Any]]:
        out = []
        for piece in plan.pieces_of(spec, sources=False):
            stored = StoredPiece(
                piece.file,
                piece.box,
                piece.block,
                piece.inner,
                int(crcs[piece.id]),
                int(sizes[piece.id]),
                piece.codec,
                None if digests is None else digests[piece.id].tobytes(),
                origins[reused[piece.id]] if reused[piece.id] >= 0 else None,
            )
            out.append(stored.to_json())
        return out

    variables: dict[str, Any] = {}
    newest = FORMAT_VERSION_UNCOMPRESSED
    for spec in plan.specs:
        if spec.kind == "value":
            variables[spec.name] = {"kind": "value", "value": values[spec.name]}
        elif spec.kind == "per_rank":
            ranks: dict[str, Any] = {
                str(r): {"kind": "value", "value": v} for r, v in values.get(spec.name, {}).items()
            }
            for k, piece in enumerate(listed(spec)):
                rank = spec.ranks[k]
                layout = "small" if piece["inner"] is None else "regular"
                ranks[str(rank)] = _tensor_entry(
                    spec.dtypes[k], spec.shapes[k], f"{spec.path}/r{rank}", layout, [piece]
                )
                if "codec" in piece:
                    newest = max(newest, FORMAT_VERSION_COMPRESSED)
            variables[spec.name] = {"kind": "per_rank", "ranks": ranks}
        elif spec.layout == "regular":
            assert spec.dtype is not None and spec.shape is not None and spec.chunks is not None
            part = slice(spec.first, spec.first + spec.count)
            variables[spec.name] = regular_entry(
                spec.dtype,
                spec.shape,
                spec.path,
                spec.chunks,
                spec.inner,
                spec.codec,
                crcs[part],
                sizes[part],
                None if digests is None else digests[part],
                reuse_column(reused[part], origins),
            )
            newest = max(newest, FORMAT_VERSION_REGULAR)
        else:
            assert spec.dtype is not None and spec.shape is not None and spec.layout is not None
            pieces = listed(spec)
            if any("codec" in p for p in pieces):
                newest = max(newest, FORMAT_VERSION_COMPRESSED)
            variables[spec.name] = _tensor_entry(
                spec.dtype, spec.shape, spec.path, spec.layout, pieces
            )
    if any(has_binary(v) for v in _stored_values(variables)):
        newest = FORMAT_VERSION
    index = {
        "format": FORMAT,
        "format_version": newest,
        "library_version": VERSION,
        "created": time.time(),
        "world_size": plan.world_size,
        "variables": variables,
    }
    if digests is not None:
        index["digests"] = ALGORITHM
    return index


def index_bytes(index: dict[str, Any]) -> bytes:
    """The root group's ``zarr.json`` holding ``index``, sealed with its checksum
    (:mod:`distckpt.format.seal`)."""
    return seal.dumps(zarr_meta.group_meta({ATTRIBUTE: seal.sealed(index)}))


def commit(
    plan: SavePlan,
    reports: Sequence[Report],
    values: dict[str, Any],
    txn: Transaction,
    save_id: str | None = None,
) -> bytes:
    """Coordinator, step 5 of the save protocol: with every rank's report in, write the
    group metadata and then the index through the save's transaction
    (:mod:`distckpt.commit.transaction`), which makes it the checkpoint; return the
    index document's bytes. ``save_id`` (the save's token) is recorded in the index."""
    index = build_index(plan, reports, values)
    if save_id is not None:
        index["save_id"] = save_id
    files = {
        f"{group}/{zarr_meta.ZARR_JSON}": zarr_meta.dumps(zarr_meta.group_meta())
        for group in plan.groups
        if group != ""
    }
    raw = index_bytes(index)
    txn.commit(files, raw)
    return raw

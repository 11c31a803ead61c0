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
    FORMAT_VERSION_BINARY,
    FORMAT_VERSION_COMPRESSED,
    FORMAT_VERSION_REGULAR,
    FORMAT_VERSION_UNCOMPRESSED,
)
from distckpt.format.shard_io import Stored
from distckpt.format.stored import StoredPiece, regular_entry, reuse_column
from distckpt.planning.pieces import SavePlan, VarSpec
from distckpt.signing import hashes, signature
from distckpt.signing.hashes import HASH_BYTES
from distckpt.signing.keys import SigningKey
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
    #: A signed save's hash of each piece (rows of 32 bytes) and the algorithm.
    hashes: np.ndarray | None = None
    hash_algorithm: str | None = None

    @classmethod
    def of(cls, written: dict[int, Stored], hashing: str | None = None) -> Report:
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
        hashes = None
        if hashing is not None:
            if not all(s.hash is not None for s in stored):
                raise CheckpointError("internal error: a piece of a signed save was not hashed")
            raw = b"".join(s.hash for s in stored)  # type: ignore[misc]
            hashes = np.frombuffer(raw, dtype=np.uint8).reshape(n, HASH_BYTES)
        return cls(ids, sizes, crcs, digests, reused, origins, hashes, hashing)

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


def _hashing(reports: Sequence[Report], signed: bool) -> str | None:
    """The algorithm every rank hashed its pieces with (None: none did). A signed save
    needs every rank's hashes, of one algorithm."""
    found = {r.hash_algorithm for r in reports}
    if not signed:
        return None
    for rank, report in enumerate(reports):
        if report.hash_algorithm is None:
            raise CheckpointError(
                f"the coordinator signs this save but rank {rank} did not hash its pieces: "
                "give every rank the same signing_key (or $DISTCKPT_SIGNING_KEY)"
            )
    if len(found) != 1:
        raise CheckpointError(
            f"the ranks hashed their pieces with different algorithms ({sorted(map(str, found))}): "
            "install the same packages on every node (the blake3 package: distckpt[sign])"
        )
    return found.pop()


def build_index(
    plan: SavePlan,
    reports: Sequence[Report],
    values: dict[str, Any],
    hashing: str | None = None,
) -> dict[str, Any]:
    """The index of a save from its plan, every rank's report and its values (by name; a
    per-rank variable's by rank); with ``hashing`` (a signed save's algorithm), each
    piece's hash and the hash of every metadata file, under ``files``."""
    sizes = np.full(plan.pieces, -1, dtype=np.int64)
    piece_hashes = np.zeros((plan.pieces if hashing else 0, HASH_BYTES), np.uint8)
    crcs = np.zeros(plan.pieces, dtype=np.int64)
    # Digests only when every rank computed them (an incremental save's).
    digests: np.ndarray | None = np.zeros((plan.pieces, PIECE_BYTES), np.uint8)
    origins: list[str] = []  # of the pieces reused, across the ranks
    reused = np.full(plan.pieces, -1, dtype=np.int16)
    for report in reports:
        sizes[report.ids] = report.sizes
        crcs[report.ids] = report.crcs
        if hashing is not None and report.hashes is not None:
            piece_hashes[report.ids] = report.hashes
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
                piece_hashes[piece.id].tobytes() if hashing else None,
            )
            out.append(stored.to_json())
            if hashing and piece.meta_file is not None and piece.meta is not None:
                files[piece.meta_file] = _file_hash(hashing, zarr_meta.dumps(piece.meta))
        return out

    files: dict[str, str] = {}

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
                piece_hashes[part] if hashing else None,
            )
            newest = max(newest, FORMAT_VERSION_REGULAR)
            if hashing:
                first = spec.piece(0, int(plan.writers[spec.first]))
                assert first.meta_file is not None and first.meta is not None
                files[first.meta_file] = _file_hash(hashing, zarr_meta.dumps(first.meta))
        else:
            assert spec.dtype is not None and spec.shape is not None and spec.layout is not None
            pieces = listed(spec)
            if any("codec" in p for p in pieces):
                newest = max(newest, FORMAT_VERSION_COMPRESSED)
            variables[spec.name] = _tensor_entry(
                spec.dtype, spec.shape, spec.path, spec.layout, pieces
            )
    if any(has_binary(v) for v in _stored_values(variables)):
        newest = FORMAT_VERSION_BINARY
    if hashing is not None:
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
    if hashing is not None:
        for group, raw in group_files(plan).items():
            files[group] = _file_hash(hashing, raw)
        index["hash_algorithm"] = hashing
        index["files"] = dict(sorted(files.items()))
    return index


def _file_hash(algorithm: str, raw: bytes) -> str:
    return hashes.digest(algorithm, raw).hex()


def group_files(plan: SavePlan) -> dict[str, bytes]:
    """The ``zarr.json`` of every group but the root, which the commit writes."""
    raw = zarr_meta.dumps(zarr_meta.group_meta())
    return {f"{group}/{zarr_meta.ZARR_JSON}": raw for group in plan.groups if group != ""}


def index_bytes(index: dict[str, Any], signer: SigningKey | None = None) -> bytes:
    """The root group's ``zarr.json`` holding ``index``, sealed with its checksum
    (:mod:`distckpt.format.seal`) and, with ``signer``, signed
    (:mod:`distckpt.signing.signature`)."""
    sealed = seal.sealed(index)
    if signer is None:
        return seal.dumps(zarr_meta.group_meta({ATTRIBUTE: sealed}))
    doc = zarr_meta.group_meta({ATTRIBUTE: signature.with_member(sealed, signer.id)})
    return signature.sign(seal.dumps(doc), signer)


def commit(
    plan: SavePlan,
    reports: Sequence[Report],
    values: dict[str, Any],
    txn: Transaction,
    save_id: str | None = None,
    signer: SigningKey | None = None,
) -> bytes:
    """Coordinator, step 5 of the save protocol: with every rank's report in, write the
    group metadata and then the index through the save's transaction
    (:mod:`distckpt.commit.transaction`), which makes it the checkpoint; return the
    index document's bytes. ``save_id`` (the save's token) is recorded in the index;
    with ``signer`` the index records every file's hash and is signed."""
    index = build_index(plan, reports, values, _hashing(reports, signer is not None))
    if save_id is not None:
        index["save_id"] = save_id
    raw = index_bytes(index, signer)
    txn.commit(group_files(plan), raw)
    return raw

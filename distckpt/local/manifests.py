"""A local step's manifests, read as an index: each saved rank's manifest lists its
pieces (box, offset and crc32c in its data file) and values; together they make an index
like a persistent checkpoint's, so that a restore matches names, kinds, shapes and dtypes
and reshards exactly as :func:`distckpt.load` does. Every field is checked before use, and
the distinct boxes of each tensor must tile its shape exactly once (replicas of one box,
as HSDP saves, are one). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distckpt import dtypes, values
from distckpt.errors import CorruptCheckpointError
from distckpt.format import wellformed
from distckpt.format.stored import stored_dtype
from distckpt.slices import Box
from distckpt.tiling import tiling_problem


@dataclass
class Piece:
    """A tensor's piece in saved rank ``owner``'s data file: ``box`` at ``offset``."""

    owner: int
    index: int  # its place in the owner's manifest
    box: Box
    offset: int
    nbytes: int
    crc: int
    itemsize: int


def checked(
    doc: dict[str, Any], where: str
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """A manifest's tensors, values and per-rank values, every field checked (as an
    index entry is, see :mod:`distckpt.format.wellformed`): names, kinds, dtypes, shapes,
    boxes inside the shape, offsets, sizes that match the box, crc32c values."""
    tensors, plain, per_rank = doc.get("tensors"), doc.get("values"), doc.get("per_rank_values")
    if not (isinstance(tensors, list) and isinstance(plain, dict) and isinstance(per_rank, dict)):
        raise CorruptCheckpointError(f"{where}: malformed manifest")
    for t in tensors:
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or t.get("kind") not in ("tensor", "per_rank"):
            raise CorruptCheckpointError(f"{where}: malformed manifest entry {t!r:.60}")
        try:
            wellformed.check_variable_name(name)
            itemsize = stored_dtype(t, name).itemsize
            shape = wellformed.shape_of(t, name, itemsize)
            _, lengths = wellformed.box_of(t.get("box"), name, shape)
            offset, nbytes, crc = t.get("offset"), t.get("nbytes"), t.get("crc")
            if not (wellformed.count(offset) and wellformed.count(crc) and crc < 1 << 32):
                raise wellformed.corrupt(name, "an offset or crc32c that is not a count")
            if nbytes != math.prod(lengths) * itemsize:
                raise wellformed.corrupt(name, f"{nbytes!r:.20} bytes for its box")
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from None
    for table in (plain, per_rank):
        for name, value in table.items():
            values.check(value, name)
    return tensors, plain, per_rank


def extent(tensors: list[dict[str, Any]], where: str) -> int:
    """Where the data of a manifest's ``tensors`` (checked by :func:`checked`) ends in its
    data file. Their bytes must not overlap there (replicas of one box at one offset, as
    HSDP saves, are one), so what a restore allocates for them is at most the bytes of
    the file: its holder compares the end with the file's size."""
    spans = sorted(
        {(t["offset"], t["nbytes"], str(t["box"]), t["name"]) for t in tensors if t["nbytes"]}
    )
    end = 0
    for offset, nbytes, box, name in spans:
        if offset < end:
            raise CorruptCheckpointError(
                f"{where}: variable {name!r}: the bytes of its box {box} overlap those of "
                "another piece in the data file"
            )
        end = offset + nbytes
    return end


def index_of(
    manifests: dict[int, dict[str, Any]], world: int, where: str
) -> tuple[dict[str, Any], dict[tuple[str, int | None], list[Piece]], dict[str, Any]]:
    """The index of a step saved by ``world`` ranks from their ``manifests`` (by saved
    rank), the pieces of each tensor (by name, and saved rank for a per-rank one), and
    what the saver kept beside; ``where`` names the step in errors."""
    variables: dict[str, Any] = {}
    pieces: dict[tuple[str, int | None], list[Piece]] = {}

    def per_rank(name: str) -> dict[str, Any]:
        entry = variables.setdefault(name, {"kind": "per_rank", "ranks": {}})
        if entry["kind"] != "per_rank":
            raise CorruptCheckpointError(f"{where}: {name!r} is per-rank on some ranks only")
        ranks: dict[str, Any] = entry["ranks"]
        return ranks

    for owner in sorted(manifests):
        tensors, plain, per_rank_values = checked(manifests[owner], f"{where}, saved rank {owner}")
        for i, t in enumerate(tensors):
            name, dtype, shape = t["name"], t["dtype"], t["shape"]
            box = Box.from_json(t["box"])
            piece = Piece(owner, i, box, t["offset"], t["nbytes"], t["crc"], dtypes.itemsize(dtype))
            described = {"kind": "tensor", "shape": shape, "dtype": dtype}
            if t["kind"] == "per_rank":
                per_rank(name)[str(owner)] = {**described, "owner": owner}
                pieces[(name, owner)] = [piece]
                continue
            entry = variables.setdefault(name, described)
            if entry != described:
                raise CorruptCheckpointError(
                    f"{where}: variable {name!r} is stored as {entry} by one rank and "
                    f"{described} by rank {owner}"
                )
            pieces.setdefault((name, None), []).append(piece)
        for name, value in plain.items():
            variables.setdefault(name, {"kind": "value", "value": value})
        for name, value in per_rank_values.items():
            per_rank(name)[str(owner)] = {"kind": "value", "value": value}
    for (name, held_by), held in pieces.items():  # before any tensor of it exists
        entry = variables[name] if held_by is None else variables[name]["ranks"][str(held_by)]
        # Replicas of one box (HSDP) are one; distinct boxes must tile the shape.
        problem = tiling_problem(list({p.box: p for p in held}), Box.full(entry["shape"]))
        if problem is not None:
            raise CorruptCheckpointError(
                f"{where}: variable {name!r}: its pieces do not tile its shape "
                f"{entry['shape']} exactly once: {problem}"
            )
    extra = (manifests[min(manifests)].get("extra") or {}) if manifests else {}
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(f"{where}: a manifest's 'extra' is not a map")
    return {"world_size": world, "variables": variables}, pieces, dict(extra)

"""``distckpt inspect``: the variables of one checkpoint, from its index alone."""

from __future__ import annotations

import math
import os
from typing import Any

from distckpt import dtypes
from distckpt.errors import CorruptCheckpointError
from distckpt.format import seal
from distckpt.format.index import read_index
from distckpt.format.stored import Pieces
from distckpt.signing.signature import MEMBER


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"world_size", "created", "bytes", "variables": [row, ...]}``: a row per stored
    name, tensors with dtype, shape, layout, bytes and their stored boxes (``slices``),
    compressed ones also with ``codecs`` and ``stored_bytes``, those with pieces taken
    from an earlier checkpoint (an incremental save) with ``reused``: {where from: the
    pieces' stored bytes}; ``bytes`` totals the tensors (per-rank ones not included),
    ``reused_bytes`` the pieces taken by every variable; ``metadata_checksum`` whether the
    index carries its own checksum (checked: False for an index written by a distckpt that
    did not seal it)."""
    index = read_index(path)
    rows: list[dict[str, Any]] = []
    for name, entry in sorted(index["variables"].items()):
        try:
            rows.append(_row(name, entry))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CorruptCheckpointError(f"variable {name!r}: malformed index entry") from None
    return {
        "world_size": index.get("world_size"),
        "created": index.get("created"),
        "metadata_checksum": getattr(index, "sealed", False),
        "signed_by": signer_of(index),
        "bytes": sum(row.get("bytes", 0) for row in rows),
        "reused_bytes": sum(sum(row.get("reused", {}).values()) for row in rows),
        "variables": rows,
    }


def _row(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    if entry.get("kind") != "tensor":
        return {"name": name, "kind": entry.get("kind")}
    row = {
        "name": name,
        "kind": "tensor",
        "dtype": entry["dtype"],
        "shape": entry["shape"],
        "layout": entry["layout"],
        "bytes": math.prod(entry["shape"]) * dtypes.itemsize(entry["dtype"]),
    }
    stored = Pieces(entry, name)
    pieces = list(stored)
    row["slices"] = [p.box.to_json() for p in pieces]
    reused: dict[str, int] = {}
    for piece, origin in zip(pieces, stored.origins(), strict=True):
        if origin is not None:
            reused[origin] = reused.get(origin, 0) + piece.size
    if reused:
        row["reused"] = reused
    compressed = sorted({p.codec.name for p in pieces if p.codec is not None})
    if compressed:  # as stored: the codecs and the bytes of the files
        row["codecs"] = compressed
        row["stored_bytes"] = sum(p.size for p in pieces)
    return row


def _count(n: Any, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_summary(path: str | os.PathLike[str], summary: dict[str, Any]) -> list[str]:
    """The lines ``distckpt inspect`` prints."""
    rows = summary["variables"]
    world = summary["world_size"]
    lines = [
        f"{path}: {_count(len(rows), 'variable')}, saved on {_count(world, 'rank')}, "
        f"{summary['bytes']} bytes of tensors"
        + (
            f", {summary['reused_bytes']} stored bytes reused from earlier checkpoints"
            if summary.get("reused_bytes")
            else ""
        )
    ]
    if summary.get("metadata_checksum") is False:
        lines.append(f"  ({seal.UNSEALED})")
    if summary.get("signed_by"):
        lines.append(f"  (signed by key {summary['signed_by']}: `distckpt verify --key` checks it)")
    for row in rows:
        if row["kind"] == "tensor":
            stored = (
                f" ({'/'.join(row['codecs'])}: {row['stored_bytes']} stored)"
                if "codecs" in row
                else ""
            )
            reused = "".join(
                f"; {n} bytes reused from {where}" for where, n in row.get("reused", {}).items()
            )
            lines.append(
                f"  {row['name']}  {row['dtype']}{row['shape']}  {row['layout']}, "
                f"{len(row['slices'])} slice(s), {row['bytes']} bytes{stored}{reused}"
            )
        else:
            lines.append(f"  {row['name']}  ({row['kind']})")
    return lines


def signer_of(index: dict[str, Any]) -> str | None:
    """The key id the index names as its signer (not checked), or None."""
    member = index.get(MEMBER)
    if isinstance(member, str) and member.count(":") == 2:
        return member.split(":")[1][:16]
    return None

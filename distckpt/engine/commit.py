"""The commit of one save: the index, the group metadata, and the rename into place.

Runs on the coordinator once every rank reported its pieces durable. The index is the root
group's ``zarr.json`` attribute ``distckpt`` (see :mod:`distckpt.storage.index`); nothing
is visible under the final name before the rename.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from distckpt import __version__
from distckpt.errors import CheckpointExists
from distckpt.planning.save_plan import Piece, SavePlan
from distckpt.storage import index as index_mod
from distckpt.storage import zarr_meta
from distckpt.storage.fsutil import fsync_dir, write_file
from distckpt.storage.staging import Staging


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


def commit(
    plan: SavePlan, reports: list[Any], staging: Staging, final: Path, overwrite: bool
) -> None:
    """Coordinator, step 5 of the save protocol: with every rank's report (``{piece id:
    (size, crc)}``) in, write the group metadata and the index, fsync them, and rename the
    staging directory to ``final`` (atomically replacing it with ``overwrite``)."""
    written: dict[int, tuple[int, int]] = {}
    for report in reports:
        written.update(report)

    def stored(piece: Piece) -> dict[str, Any]:
        size, crc = written[piece.id]
        return index_mod.StoredPiece(
            piece.file, piece.box, piece.block, piece.inner, crc, size, piece.codec
        ).to_json()

    variables: dict[str, Any] = {}
    for var in plan.variables:
        if var.kind == "value":
            variables[var.name] = {"kind": "value", "value": var.value}
        elif var.kind == "per_rank":
            ranks: dict[str, Any] = {
                str(r): {"kind": "value", "value": v} for r, v in var.per_rank_values.items()
            }
            for piece in var.pieces:
                assert piece.meta is not None and piece.rank is not None
                shape = tuple(piece.meta["shape"])
                layout = "small" if piece.inner is None else "regular"
                ranks[str(piece.rank)] = _tensor_entry(
                    piece.meta["data_type"],
                    shape,
                    piece.file.rsplit("/", 1)[0],
                    layout,
                    [stored(piece)],
                )
            variables[var.name] = {"kind": "per_rank", "ranks": ranks}
        else:
            assert var.dtype is not None and var.shape is not None and var.layout is not None
            variables[var.name] = _tensor_entry(
                var.dtype, var.shape, var.path, var.layout, [stored(p) for p in var.pieces]
            )
    compressed = any(p.codec is not None for var in plan.variables for p in var.pieces)
    index = {
        "format": index_mod.FORMAT,
        "format_version": (
            index_mod.FORMAT_VERSION if compressed else index_mod.FORMAT_VERSION_UNCOMPRESSED
        ),
        "library_version": __version__,
        "created": time.time(),
        "world_size": plan.world_size,
        "variables": variables,
    }
    root = staging.path
    for group in plan.groups:
        if group == "":
            continue
        (root / group).mkdir(parents=True, exist_ok=True)
        write_file(root / group / zarr_meta.ZARR_JSON, zarr_meta.dumps(zarr_meta.group_meta()))
    for group in sorted(plan.groups, key=lambda g: -g.count("/")):
        if group:
            fsync_dir(root / group)
    doc = zarr_meta.group_meta({index_mod.ATTRIBUTE: index})
    write_file(
        root / zarr_meta.ZARR_JSON, json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    )
    if final.exists() and not overwrite and index_mod.is_committed(final):
        raise CheckpointExists(f"{final} was committed by another save while this one ran")
    staging.commit(overwrite=overwrite)

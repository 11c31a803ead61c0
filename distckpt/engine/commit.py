"""The commit of one save: the group metadata and the index.

Runs on the coordinator once every rank reported its pieces durable. The index is the root
group's ``zarr.json`` attribute ``distckpt`` (see :mod:`distckpt.storage.index`); nothing
is a checkpoint under the final name before the transaction commits it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from distckpt import __version__
from distckpt.planning.save_plan import Piece, SavePlan
from distckpt.storage import index as index_mod
from distckpt.storage import zarr_meta
from distckpt.storage.transaction import Transaction


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


def commit(plan: SavePlan, reports: list[Any], txn: Transaction) -> None:
    """Coordinator, step 5 of the save protocol: with every rank's report (``{piece id:
    (size, crc)}``) in, write the group metadata and then the index through the save's
    transaction (:mod:`distckpt.storage.transaction`), which makes it the checkpoint."""
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
    files = {
        f"{group}/{zarr_meta.ZARR_JSON}": zarr_meta.dumps(zarr_meta.group_meta())
        for group in plan.groups
        if group != ""
    }
    doc = zarr_meta.group_meta({index_mod.ATTRIBUTE: index})
    txn.commit(files, json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

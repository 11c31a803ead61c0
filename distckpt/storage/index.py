"""The checkpoint index: versioned JSON in the root group's ``zarr.json`` attributes.

Layout of ``<checkpoint>/zarr.json``::

    {"zarr_format": 3, "node_type": "group",
     "attributes": {"distckpt": {
         "format": "distckpt", "format_version": 1, "library_version": "...",
         "created": <unix time>, "world_size": 4,
         "variables": {
             "net/l1.weight": {"kind": "tensor", "dtype": "float32", "shape": [8, 4],
                               "path": "net/l1.weight", "layout": "regular",
                               "pieces": [{"file": "net/l1.weight/c.0.0",
                                           "box": [[0, 0], [4, 4]], "block": [4, 4],
                                           "inner": [4, 4], "crc": 123, "size": 88,
                                           "codec": {"name": "zstd", ...}}]},
             "step": {"kind": "value", "value": 10},
             "rng": {"kind": "per_rank", "ranks": {"0": {<tensor entry>} | {"value": ...}}}}}}}

A checkpoint is committed exactly when its index exists under its final name: on a file
system the index is written last into the staging directory, which is then renamed; on
an object store the index object is the last written, created only if absent
(:mod:`distckpt.storage.transaction`). Nothing else in the
directory is trusted unless the index names it. ``crc`` is the piece's data checksum:
the crc32c of a shard's checksum table, or of a plain chunk's bytes
(see :mod:`distckpt.storage.shard_io`).

``codec``, present only on a compressed piece, is the zarr v3 JSON of the codec that
compressed each of its inner chunks (:mod:`distckpt.storage.codecs`); the checksum table
and the crc32c after each inner chunk are then of the compressed bytes, as stored.
A checkpoint with a compressed piece has ``format_version`` 2, so a distckpt that
predates compression refuses it clearly instead of misreading it; one without any stays
at version 1, readable by every distckpt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from distckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from distckpt.slices import Box
from distckpt.storage import codecs, zarr_meta
from distckpt.storage.backend import Store, resolve

FORMAT = "distckpt"
FORMAT_VERSION = 2
#: The version of a checkpoint with no compressed piece (format 1 had no compression).
FORMAT_VERSION_UNCOMPRESSED = 1
ATTRIBUTE = "distckpt"


@dataclass(frozen=True)
class StoredPiece:
    file: str
    box: Box
    block: tuple[int, ...]
    inner: tuple[int, ...] | None
    crc: int
    size: int
    codec: codecs.Codec | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "file": self.file,
            "box": self.box.to_json(),
            "block": list(self.block),
            "inner": None if self.inner is None else list(self.inner),
            "crc": self.crc,
            "size": self.size,
        }
        if self.codec is not None:
            doc["codec"] = self.codec.to_json()
        return doc

    @classmethod
    def from_json(cls, data: dict[str, Any], variable: str) -> StoredPiece:
        """A piece as the index records it; ``variable`` names it in errors (an unknown
        codec raises :class:`~distckpt.errors.UnsupportedFormatError`)."""
        inner = data.get("inner")
        codec = data.get("codec")
        return cls(
            file=data["file"],
            box=Box.from_json(data["box"]),
            block=tuple(data["block"]),
            inner=None if inner is None else tuple(inner),
            crc=int(data["crc"]),
            size=int(data["size"]),
            codec=None if codec is None else codecs.from_json(codec, variable),
        )


def read_index(checkpoint: str | os.PathLike[str] | Store) -> dict[str, Any]:
    """The index of a committed checkpoint, checked for format and version."""
    store = resolve(checkpoint)
    path = store.where(zarr_meta.ZARR_JSON)
    try:
        raw = store.read(zarr_meta.ZARR_JSON)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if store.is_dir(""):
            raise CheckpointNotFoundError(
                f"{store.url} is not a distckpt checkpoint (no zarr.json index)"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {store.url}") from None
    try:
        doc = json.loads(raw)
        index = doc["attributes"][ATTRIBUTE]
    except ValueError:
        raise CorruptCheckpointError(f"{path}: the index is not readable JSON") from None
    except (KeyError, TypeError):
        raise CheckpointNotFoundError(
            f"{checkpoint} is not a distckpt checkpoint (its zarr.json has no '{ATTRIBUTE}' index)"
        ) from None
    if index.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: unknown format {index.get('format')!r}")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{checkpoint} was written in distckpt format version {version}; this distckpt "
            f"reads versions up to {FORMAT_VERSION}: upgrade distckpt to read it"
        )
    if not isinstance(index.get("variables"), dict):
        raise CorruptCheckpointError(f"{path}: index has no variables table")
    return index


def is_committed(checkpoint: str | os.PathLike[str] | Store) -> bool:
    """Whether ``checkpoint`` holds a distckpt index (of any format version)."""
    try:
        read_index(checkpoint)
    except UnsupportedFormatError:
        return True
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return False
    return True

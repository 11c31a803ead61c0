"""The checkpoint index: versioned JSON in the root group's ``zarr.json`` attributes.

Layout of ``<checkpoint>/zarr.json``::

    {"zarr_format": 3, "node_type": "group",
     "attributes": {"distckpt": {
         "checksum": "crc32c:5e4c1a0b",
         "format": "distckpt", "format_version": 3, "library_version": "...",
         "created": <unix time>, "world_size": 4, "save_id": "<16 hex digits>",
         "variables": {
             "net/l1.weight": {"kind": "tensor", "dtype": "float32", "shape": [8, 4],
                               "path": "net/l1.weight", "layout": "regular",
                               "chunks": [4, 4], "inner": [4, 4],
                               "crc": [123, 456], "size": [88, 88]},
             "net/l1.bias": {"kind": "tensor", "dtype": "float32", "shape": [8],
                             "path": "net/l1.bias", "layout": "small",
                             "pieces": [{"file": "net/l1.bias/c.0", "box": [[0], [8]],
                                         "block": [8], "inner": null, "crc": 7, "size": 36}]},
             "step": {"kind": "value", "value": 10},
             "rng": {"kind": "per_rank", "ranks": {"0": {<tensor entry>} | {"value": ...}}}}}}}

A **regular** array (``layout`` "regular") is one zarr array of ``chunks``-shaped shards,
stored compactly whatever its number of shards: shard ``k`` (in C order of the grid
coordinates) is the file ``<path>/c.<i>.<j>``, holds the box its coordinate gives, and
``crc[k]`` and ``size[k]`` are its checksum and bytes; ``codec``, if present, compressed
every shard's inner chunks. ``crc`` and ``size`` are JSON lists, or for more than
:data:`~distckpt.format.stored.INLINE_PIECES` shards the base64 of little-endian
``uint32``/``uint64`` arrays (a job of 8,192 ranks writes 8,192 shards of each
variable). The other layouts list their pieces one by one (``pieces``): a small tensor's
one plain chunk, an irregular partition's boxes, a per-rank tensor's array.
:class:`~distckpt.format.stored.Pieces` reads both forms.

A checkpoint is committed exactly when its index exists under its final name: on a file
system the index is written last into the staging directory, which is then renamed; on
an object store the index object is the last written, created only if absent
(:mod:`distckpt.commit.transaction`). Nothing else in the
directory is trusted unless the index names it. ``crc`` is the piece's data checksum:
the crc32c of a shard's checksum table, or of a plain chunk's bytes
(see :mod:`distckpt.format.shard_io`).

``codec``, on a compressed regular entry or piece, is the zarr v3 JSON of the codec that
compressed each of its inner chunks (:mod:`distckpt.format.codecs`); the checksum table
and the crc32c after each inner chunk are then of the compressed bytes, as stored.

``digest`` (an incremental save's, optional) is each piece's content digest
(:mod:`distckpt.format.digests`, 16 bytes: 32 hex digits, a regular entry's as a
column like ``crc``), which the next save compares to decide that a piece is unchanged.
``reused`` names the checkpoint a piece was taken from instead of written (its name
when it lies beside this one, else its location): on a listed piece the name, on a
regular entry ``{"from": [names], "pieces": column}`` where the column holds, per
shard, 0 for a shard written and ``k`` for one taken from ``from[k - 1]``. Both are
information for readers that want them: a reader that does not know them reads the
checkpoint as before.
``checksum``, the first member of the ``distckpt`` object, seals the whole file: the
crc32c of the root ``zarr.json`` as stored with its own 8 digits read as ``00000000``
(:mod:`distckpt.format.seal` specifies it). Every reader checks it before anything
else, so a damaged byte that leaves the JSON well-formed (another offset, shape or
checksum) is refused as damaged instead of read as written. An index without it was
written by a distckpt that did not seal its index: it is read as before (and logged).
The member changes no format version: a distckpt that predates it skips it and reads a
sealed checkpoint as it reads any other of its version.

Format versions: 1 lists every piece, uncompressed; 2 adds compressed pieces; 3 adds the
compact regular entries; 4 binary values; 5 signed checkpoints (a ``signature`` member,
``hash_algorithm``, ``files``, a ``hash`` of every piece, and a hash table in every
shard: :mod:`distckpt.signing`). A checkpoint records the lowest version that reads it,
so a distckpt that predates a feature it uses refuses it clearly instead of misreading it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import crc32c as _crc32c

from distckpt import values
from distckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from distckpt.format import schema, seal, wellformed, zarr_meta
from distckpt.format.stored import Pieces, stored_dtype
from distckpt.numbering import number
from distckpt.signing.keys import TrustedKeys
from distckpt.signing.trust import check_index
from distckpt.storage.backend import Store
from distckpt.storage.registry import open_store

#: The ``format`` member of every index.
FORMAT = "distckpt"
#: The newest version this distckpt reads and writes: a signed checkpoint, whose shards
#: hold a hash table (:mod:`distckpt.format.shard_io`; older readers would refuse their
#: sizes, so they are told to upgrade instead).
FORMAT_VERSION = 5
#: The version of a checkpoint holding a binary value (``bytes`` or ``io.BytesIO``, see
#: :mod:`distckpt.values`), unsigned.
FORMAT_VERSION_BINARY = 4
#: The version of a checkpoint with no regular entry and no compressed piece.
FORMAT_VERSION_UNCOMPRESSED = 1
#: The version of a checkpoint with compressed pieces but no regular entry.
FORMAT_VERSION_COMPRESSED = 2
#: The version of a checkpoint with a regular entry (and no binary value).
FORMAT_VERSION_REGULAR = 3
#: The member of the root group's ``attributes`` that holds the index.
ATTRIBUTE = "distckpt"
#: A save's identity as the index records it (``save_id``, optional: the save's token).
SAVE_ID = re.compile(r"[0-9a-f]{1,64}")


def read_index(
    checkpoint: str | os.PathLike[str] | Store,
    *,
    tiling: bool = True,
    trusted: TrustedKeys | None = None,
) -> Index:
    """The index of a committed checkpoint, checked for format and version (``tiling``:
    see :func:`check_entry`); with ``trusted``, checked to be signed by one of those keys
    with every file it lists as signed (:func:`distckpt.signing.trust.check_index`)."""
    store = open_store(checkpoint)
    raw = read_index_bytes(store)
    signer = None if trusted is None else check_index(raw, store, trusted)
    index = parse_index(raw, store, tiling=tiling)
    index.signed_by = signer
    return index


def read_index_bytes(store: Store) -> bytes:
    """The bytes of a committed checkpoint's index document (its root ``zarr.json``)."""
    try:
        return store.read(zarr_meta.ZARR_JSON)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if store.is_dir(""):
            raise CheckpointNotFoundError(
                f"{store.url} is not a distckpt checkpoint (no zarr.json index)"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {store.url}") from None


def parse_index(raw: bytes, store: Store, *, tiling: bool = True) -> Index:
    """The index in ``raw`` (the root ``zarr.json`` of ``store``), checked for format and
    version (``tiling``: see :func:`check_entry`)."""
    path = store.where(zarr_meta.ZARR_JSON)
    try:
        doc = json.loads(raw)
        index = doc["attributes"][ATTRIBUTE]
    except (ValueError, RecursionError):
        raise CorruptCheckpointError(f"{path}: the index is not readable JSON") from None
    except (KeyError, TypeError):
        raise CheckpointNotFoundError(
            f"{store.url} is not a distckpt checkpoint (its zarr.json has no '{ATTRIBUTE}' index)"
        ) from None
    # The seal first: a damaged byte is named as such, not as whatever it became.
    sealed = isinstance(index, dict) and seal.check(raw, path, index)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        what = index.get("format") if isinstance(index, dict) else index
        raise CorruptCheckpointError(f"{path}: unknown format {what!r}")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{store.url} was written in distckpt format version {version}; this distckpt "
            f"reads versions up to {FORMAT_VERSION}: upgrade distckpt to read it"
        )
    if not isinstance(index.get("variables"), dict):
        raise CorruptCheckpointError(f"{path}: index has no variables table")
    world = index.get("world_size", 1)
    if type(world) is not int or world < 1:
        raise CorruptCheckpointError(f"{path}: index has a world size of {world!r:.60}")
    created = index.get("created", 0)
    if type(created) not in (int, float) or not 0 <= created < 2**33:  # (until 2242)
        raise CorruptCheckpointError(f"{path}: index has a creation time of {created!r:.60}")
    save_id = index.get("save_id", "0")
    if not isinstance(save_id, str) or not SAVE_ID.fullmatch(save_id):
        raise CorruptCheckpointError(f"{path}: index has a save id of {save_id!r:.60}")
    checked = Index(seal.strip(index), version_of(raw), sealed=sealed)
    for name, entry in index["variables"].items():
        try:
            wellformed.check_variable_name(name)
            check_entry(entry, name, made=checked.pieces, tiling=tiling)
        except CheckpointError as exc:
            raise type(exc)(f"{store.url}: {exc}") from None
    # The published schema last: what the checks above name more precisely is named so.
    wrong = schema.problem(doc)
    if wrong is not None:
        raise CorruptCheckpointError(f"{path}: the index does not follow its schema {wrong}")
    return checked


class Index(dict[str, Any]):
    """A parsed and checked index document (without its ``checksum`` member); ``pieces``
    holds the :class:`Pieces` made while checking its tensor entries (by ``id`` of the
    entry, which the document keeps alive), so that a reader does not parse them again
    (:func:`pieces_of`); ``version`` names the bytes it was read from
    (:func:`version_of`); ``sealed`` says whether they carried a checksum (False: written
    by a distckpt that did not seal its index)."""

    def __init__(
        self, doc: dict[str, Any], version: str | None = None, *, sealed: bool = False
    ) -> None:
        super().__init__(doc)
        self.pieces: dict[int, Pieces] = {}
        self.version = version
        self.sealed = sealed
        #: The key id whose signature over these bytes a reader checked, else None
        #: (:mod:`distckpt.signing`).
        self.signed_by: str | None = None


def version_of(raw: bytes) -> str:
    """A name of an index document's bytes: equal bytes, equal names."""
    return f"{_crc32c.crc32c(raw):08x}-{len(raw)}"


def pieces_of(index: dict[str, Any], entry: dict[str, Any], variable: str) -> Pieces:
    """The stored pieces of ``entry``, a tensor entry of ``index``: made when the index
    was checked, else now."""
    made = index.pieces.get(id(entry)) if isinstance(index, Index) else None
    return made if made is not None else Pieces(entry, variable)


def check_entry(
    entry: Any,
    variable: str,
    *,
    located: bool = True,
    made: dict[int, Pieces] | None = None,
    tiling: bool = True,
) -> None:
    """Check one entry of an index's variables table, so that every reader can trust its
    kind, dtype, shape, pieces and value (see :mod:`distckpt.format.wellformed`), and
    that its pieces tile its shape exactly once (``tiling=False``: all but that, which
    ``distckpt verify`` reports itself); ``located=False``: the entry names no pieces
    (the node-local tier's). Raises :class:`CorruptCheckpointError` naming ``variable``;
    ``made`` collects the :class:`Pieces` made."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "tensor":
        if located:
            pieces = Pieces(entry, variable, tiling=tiling)
            if made is not None:
                made[id(entry)] = pieces
        else:
            wellformed.shape_of(entry, variable, stored_dtype(entry, variable).itemsize)
    elif kind == "value" and "value" in entry:
        values.check(entry["value"], variable)
    elif kind == "per_rank" and isinstance(entry.get("ranks"), dict):
        for rank, sub in entry["ranks"].items():
            if number(rank) is None:
                raise wellformed.corrupt(variable, f"a per-rank entry of rank {rank!r:.60}")
            if not isinstance(sub, dict) or sub.get("kind") == "per_rank":
                raise wellformed.corrupt(variable, f"malformed entry of rank {rank}")
            check_entry(sub, variable, located=located, made=made, tiling=tiling)
    else:
        raise wellformed.corrupt(variable, "malformed index entry")


def is_committed(checkpoint: str | os.PathLike[str] | Store) -> bool:
    """Whether ``checkpoint`` holds a distckpt index (of any format version)."""
    try:
        read_index(checkpoint)
    except UnsupportedFormatError:
        return True
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return False
    return True

"""The checkpoint index: versioned JSON in the root group's ``zarr.json`` attributes.

Layout of ``<checkpoint>/zarr.json``::

    {"zarr_format": 3, "node_type": "group",
     "attributes": {"distckpt": {
         "format": "distckpt", "format_version": 3, "library_version": "...",
         "created": <unix time>, "world_size": 4,
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
:data:`INLINE_PIECES` shards the base64 of little-endian ``uint32``/``uint64`` arrays
(a job of 8,192 ranks writes 8,192 shards of each variable). The other layouts list their
pieces one by one (``pieces``): a small tensor's one plain chunk, an irregular partition's
boxes, a per-rank tensor's array. :class:`Pieces` reads both forms.

A checkpoint is committed exactly when its index exists under its final name: on a file
system the index is written last into the staging directory, which is then renamed; on
an object store the index object is the last written, created only if absent
(:mod:`distckpt.storage.transaction`). Nothing else in the
directory is trusted unless the index names it. ``crc`` is the piece's data checksum:
the crc32c of a shard's checksum table, or of a plain chunk's bytes
(see :mod:`distckpt.storage.shard_io`).

``codec``, on a compressed regular entry or piece, is the zarr v3 JSON of the codec that
compressed each of its inner chunks (:mod:`distckpt.storage.codecs`); the checksum table
and the crc32c after each inner chunk are then of the compressed bytes, as stored.

``digest`` (an incremental save's, optional) is each piece's content digest
(:mod:`distckpt.storage.digests`, 16 bytes: 32 hex digits, a regular entry's as a
column like ``crc``), which the next save compares to decide that a piece is unchanged.
``reused`` names the checkpoint a piece was taken from instead of written (its name
when it lies beside this one, else its location): on a listed piece the name, on a
regular entry ``{"from": [names], "pieces": column}`` where the column holds, per
shard, 0 for a shard written and ``k`` for one taken from ``from[k - 1]``. Both are
information for readers that want them: a reader that does not know them reads the
checkpoint as before.
Format versions: 1 lists every piece, uncompressed; 2 adds compressed pieces; 3 adds the
compact regular entries. A checkpoint records the lowest version that reads it, so a
distckpt that predates a feature it uses refuses it clearly instead of misreading it.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np

from distckpt import dtypes, values
from distckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from distckpt.slices import Box
from distckpt.storage import codecs, digests, wellformed, zarr_meta
from distckpt.storage.backend import Store, resolve

FORMAT = "distckpt"
FORMAT_VERSION = 3
#: The version of a checkpoint with no regular entry and no compressed piece.
FORMAT_VERSION_UNCOMPRESSED = 1
#: The version of a checkpoint with compressed pieces but no regular entry.
FORMAT_VERSION_COMPRESSED = 2
ATTRIBUTE = "distckpt"
#: A regular entry's ``crc`` and ``size`` are JSON lists up to this many shards, base64
#: beyond (compact, and decoded without a Python object per shard).
INLINE_PIECES = 64


@dataclass(frozen=True)
class StoredPiece:
    file: str
    box: Box
    block: tuple[int, ...]
    inner: tuple[int, ...] | None
    crc: int
    size: int
    codec: codecs.Codec | None = None
    digest: bytes | None = None
    reused: str | None = None

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
        if self.digest is not None:
            doc["digest"] = self.digest.hex()
        if self.reused is not None:
            doc["reused"] = self.reused
        return doc

    @classmethod
    def from_json(cls, data: Any, variable: str) -> StoredPiece:
        """A piece as the index records it, checked for types (not yet against its
        variable: see :class:`Pieces`); ``variable`` names it in errors (an unknown codec
        raises :class:`~distckpt.errors.UnsupportedFormatError`)."""
        if not isinstance(data, dict):
            raise wellformed.corrupt(variable, f"a piece that is not an object: {data!r:.60}")
        offsets, lengths = wellformed.box_of(data.get("box"), variable)
        block = wellformed.counts(data.get("block"), variable, "block")
        inner = data.get("inner")
        crc: Any = data.get("crc")
        size: Any = data.get("size")
        codec = data.get("codec")
        if not (wellformed.count(crc) and crc < 1 << 32 and wellformed.count(size)):
            raise wellformed.corrupt(variable, "a piece whose crc or size is not a count")
        return cls(
            file=wellformed.check_file(data.get("file"), variable),
            box=Box.known(offsets, lengths),
            block=block,
            inner=None if inner is None else wellformed.counts(inner, variable, "inner chunks"),
            crc=crc,
            size=size,
            codec=None if codec is None else codecs.from_json(codec, variable),
            digest=_digest(data.get("digest"), variable),
            reused=_origin(data.get("reused"), variable),
        )

    def check(self, variable: str, shape: tuple[int, ...], itemsize: int) -> StoredPiece:
        """This piece, checked against its variable (see :func:`wellformed.check_piece`)."""
        wellformed.check_piece(
            variable,
            self.file,
            shape,
            self.box.offsets,
            self.box.lengths,
            self.block,
            self.inner,
            self.size,
            itemsize,
            self.codec is not None,
        )
        return self


def _digest(value: Any, variable: str) -> bytes | None:
    """A listed piece's ``digest``: absent, or 32 hex digits."""
    if value is None:
        return None
    if isinstance(value, str) and len(value) == 2 * digests.PIECE_BYTES:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise wellformed.corrupt(variable, f"a piece digest that is not 32 hex digits: {value!r:.60}")


def _origin(value: Any, variable: str) -> str | None:
    """Where a piece was reused from (shown, never opened): a short printable string."""
    if value is None:
        return None
    if isinstance(value, str) and 0 < len(value) <= 4096 and value.isprintable():
        return value
    raise wellformed.corrupt(variable, f"a piece's origin that is not a name: {value!r:.60}")


def stored_dtype(entry: dict[str, Any], variable: str) -> np.dtype:
    """The NumPy dtype of a tensor entry (an unknown or malformed one is corrupt)."""
    name = entry.get("dtype")
    try:
        if not isinstance(name, str):
            raise UnsupportedValueError(f"a dtype that is not a name: {name!r:.60}")
        return dtypes.numpy_dtype(name)
    except UnsupportedValueError as exc:
        raise wellformed.corrupt(variable, str(exc)) from None


def column(values: np.ndarray) -> list[int] | list[str] | str:
    """A regular entry's column: a list of ints (of hex strings for digests, rows of
    bytes), or base64 when long."""
    if len(values) <= INLINE_PIECES:
        if values.ndim == 2:
            return [row.tobytes().hex() for row in values]
        return [int(v) for v in values.tolist()]
    if values.ndim == 2:
        return base64.b64encode(values.tobytes()).decode()
    return base64.b64encode(values.astype(values.dtype.newbyteorder("<")).tobytes()).decode()


def reuse_column(which: np.ndarray, origins: list[str]) -> dict[str, Any] | None:
    """A regular entry's ``reused``, from each shard's index into ``origins`` (-1: written),
    or None when every shard was written."""
    if not len(which) or which.max() < 0:
        return None
    used = sorted({int(k) for k in which.tolist() if k >= 0})
    names = [origins[k] for k in used]
    at = {k: j + 1 for j, k in enumerate(used)}
    pieces = np.fromiter((at.get(int(k), 0) for k in which.tolist()), np.uint16, len(which))
    return {"from": names, "pieces": column(pieces)}


class Column:
    """A regular entry's ``crc`` or ``size`` column, decoded lazily: a rank reading a few
    shards of a variable of thousands decodes only their entries, not the whole column."""

    def __init__(self, data: Any, dtype: str, count: int, variable: str, name: str) -> None:
        self.dtype = np.dtype(dtype)
        self.count = count
        self.variable, self.name = variable, name
        self._values: np.ndarray | None = None
        self._text: str | None = None
        if isinstance(data, str):
            if len(data) != 4 * -(-count * self.dtype.itemsize // 3):
                raise self._error(f"does not hold {count} entries")
            self._text = data
        elif isinstance(data, list) and len(data) == count:
            limit = 1 << min(8 * self.dtype.itemsize, 62)
            if not all(type(v) is int and 0 <= v < limit for v in data):
                raise self._error("holds something other than counts")
            self._values = np.asarray(data, dtype=self.dtype) if data else np.zeros(0, self.dtype)
        else:
            raise self._error(f"does not hold {count} entries")

    def _error(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"variable {self.variable!r}: the index's {self.name} column {what}"
        )

    def _decode(self, first: int, end: int) -> np.ndarray:
        assert self._text is not None
        size = self.dtype.itemsize
        lo, hi = first * size, end * size  # bytes wanted
        start, stop = lo // 3 * 4, -(-hi // 3) * 4  # base64 characters holding them
        try:
            raw = base64.b64decode(self._text[start:stop], validate=True)
        except ValueError:
            raise self._error("is not base64") from None
        skip = lo - start // 4 * 3
        return np.frombuffer(raw[skip : skip + hi - lo], dtype=self.dtype)

    def __getitem__(self, k: int) -> int:
        return int(self.span(k, k + 1)[0])

    def span(self, first: int, end: int) -> np.ndarray:
        """Entries ``first`` to ``end`` (exclusive)."""
        if self._values is not None:
            return self._values[first:end]
        return self._decode(first, end)

    def values(self) -> np.ndarray:
        if self._values is None:
            self._values = self._decode(0, self.count)
        return self._values


def regular_entry(
    dtype: str,
    shape: tuple[int, ...],
    path: str,
    chunks: tuple[int, ...],
    inner: tuple[int, ...] | None,
    codec: codecs.Codec | None,
    crc: np.ndarray,
    size: np.ndarray,
    digest: np.ndarray | None = None,
    reused: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The index entry of a regular array (``crc``, ``size``, ``digest``: by shard, C
    order; ``reused``: from :func:`reuse_column`)."""
    entry: dict[str, Any] = {
        "kind": "tensor",
        "dtype": dtype,
        "shape": list(shape),
        "path": path,
        "layout": "regular",
        "chunks": list(chunks),
        "inner": None if inner is None else list(inner),
    }
    if codec is not None:
        entry["codec"] = codec.to_json()
    entry["crc"] = column(crc.astype(np.uint32))
    entry["size"] = column(size.astype(np.uint64))
    if digest is not None:
        entry["digest"] = column(digest)
    if reused is not None:
        entry["reused"] = reused
    return entry


class Pieces:
    """The stored pieces of one tensor entry of the index, in either form: compact
    (a regular entry: ``chunks``, ``crc``, ``size``) or listed (``pieces``). Checked on
    construction: a malformed entry raises :class:`CorruptCheckpointError`, an unknown
    codec :class:`UnsupportedFormatError`, naming ``variable``."""

    def __init__(self, entry: Any, variable: str) -> None:
        self.variable = variable
        self._listed: list[StoredPiece] | None = None
        if not isinstance(entry, dict):
            raise wellformed.corrupt(variable, "malformed index entry")
        self.itemsize = stored_dtype(entry, variable).itemsize
        self.shape = shape = wellformed.shape_of(entry, variable, self.itemsize)
        if "chunks" not in entry:
            listed = entry.get("pieces")
            if not isinstance(listed, list):
                raise wellformed.corrupt(variable, "malformed index entry (no pieces)")
            self._listed = [
                StoredPiece.from_json(p, variable).check(variable, shape, self.itemsize)
                for p in listed
            ]
            return
        self.path = wellformed.check_file(entry.get("path"), variable)
        self.chunks = chunks = wellformed.counts(
            entry["chunks"], variable, "chunks", ndim=len(shape)
        )
        if chunks and min(chunks) <= 0:
            raise wellformed.corrupt(variable, f"the index's chunks {list(chunks)} are empty")
        inner = entry.get("inner")
        self.inner = (
            None if inner is None else wellformed.counts(inner, variable, "inner", ndim=len(shape))
        )
        if self.inner is not None and any(i <= 0 or c % i for c, i in zip(chunks, self.inner)):
            raise wellformed.corrupt(
                variable, f"inner chunks {list(self.inner)} do not divide the chunks {list(chunks)}"
            )
        codec = entry.get("codec")
        self.codec = None if codec is None else codecs.from_json(codec, variable)
        self.grid = tuple([-(-n // c) for n, c in zip(shape, chunks)])
        count = math.prod(self.grid)
        self.crc = Column(entry.get("crc"), "<u4", count, variable, "crc")
        self.size = Column(entry.get("size"), "<u8", count, variable, "size")
        self._digest = entry.get("digest")
        self._digest_cache: np.ndarray | None = None
        self._reused = entry.get("reused")
        if self._digest is not None:
            self._digest_rows(count)  # malformed: corrupt now, not when first asked
        if self._reused is not None:
            self._reuse_rows(count)

    def __len__(self) -> int:
        return len(self._listed) if self._listed is not None else self.crc.count

    def _digest_rows(self, count: int) -> np.ndarray:
        if self._digest_cache is not None:
            return self._digest_cache
        data, width = self._digest, digests.PIECE_BYTES
        try:
            if isinstance(data, list) and len(data) == count:
                raw = b"".join(bytes.fromhex(d) for d in data if isinstance(d, str))
            elif isinstance(data, str):
                raw = base64.b64decode(data, validate=True)
            else:
                raw = b""
        except ValueError:
            raw = b""
        if len(raw) != count * width:
            raise wellformed.corrupt(self.variable, "the index's digest column is malformed")
        self._digest_cache = np.frombuffer(raw, np.uint8).reshape(count, width)
        return self._digest_cache

    def _reuse_rows(self, count: int) -> tuple[list[str | None], np.ndarray]:
        doc = self._reused
        names = doc.get("from") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or not isinstance(names, list) or not 0 < len(names) < 65535:
            raise wellformed.corrupt(self.variable, "the index's reused entry is malformed")
        origins = [None, *(_origin(n, self.variable) for n in names)]
        which = Column(doc.get("pieces"), "<u2", count, self.variable, "reused").values()
        if len(which) and int(which.max()) >= len(origins):
            raise wellformed.corrupt(self.variable, "the index's reused column is out of range")
        return origins, which

    def _provenanced(self, piece: StoredPiece, k: int) -> StoredPiece:
        digest, reused = self.provenance(k)
        return dataclasses.replace(piece, digest=digest, reused=reused)

    def position(self, piece: StoredPiece) -> int:
        """The place of ``piece`` (one of these) in iteration order."""
        if self._listed is not None:
            return self._listed.index(piece)
        return self._linear(tuple(o // c for o, c in zip(piece.box.offsets, self.chunks)))

    def provenance(self, k: int) -> tuple[bytes | None, str | None]:
        """Piece ``k``'s content digest and where it was reused from (None, None: the
        index records neither)."""
        if self._listed is not None:
            return self._listed[k].digest, self._listed[k].reused
        digest = None if self._digest is None else self._digest_rows(len(self))[k].tobytes()
        origin = None
        if self._reused is not None:
            names, which = self._reuse_rows(len(self))
            origin = names[int(which[k])]
        return digest, origin

    def digests(self) -> list[bytes | None]:
        """Each piece's content digest, in iteration order (None where the index has none)."""
        if self._listed is not None:
            return [p.digest for p in self._listed]
        if self._digest is None:
            return [None] * len(self)
        return [row.tobytes() for row in self._digest_rows(len(self))]

    def origins(self) -> list[str | None]:
        """Where each piece was reused from, in iteration order (None: written)."""
        if self._listed is not None:
            return [p.reused for p in self._listed]
        if self._reused is None:
            return [None] * len(self)
        names, which = self._reuse_rows(len(self))
        return [names[int(k)] for k in which.tolist()]

    def __iter__(self) -> Iterator[StoredPiece]:
        """Every piece, with its digest and origin (a read plan's :meth:`covering` leaves
        those out: it has no use for them)."""
        if self._listed is not None:
            return iter(self._listed)
        coords = itertools.product(*map(range, self.grid))
        if self._digest is None and self._reused is None:
            return (self._piece(coord) for coord in coords)
        return (self._provenanced(self._piece(coord), k) for k, coord in enumerate(coords))

    def check_backed(self) -> None:
        """Raise unless the stored pieces can hold the declared shape: checked before a
        tensor of it is allocated (for a target the checkpoint describes, not the user)."""
        declared = math.prod(self.shape) * self.itemsize
        if self._listed is not None:
            capacity = sum(p.size * (wellformed.MAX_RATIO if p.codec else 1) for p in self._listed)
        else:
            capacity = self.stored_bytes * (wellformed.MAX_RATIO if self.codec else 1)
        if capacity < declared:
            raise wellformed.corrupt(
                self.variable,
                f"a shape {list(self.shape)} of {declared} bytes stored in {self.stored_bytes}",
            )

    @property
    def stored_bytes(self) -> int:
        if self._listed is not None:
            return sum(p.size for p in self._listed)
        return int(self.size.values().sum())

    def covering(self, box: Box) -> list[StoredPiece]:
        """The pieces that hold part of ``box`` (global coordinates): for a regular entry
        found by arithmetic on the grid, so a rank's read plan costs what it reads."""
        if self._listed is not None:
            return [p for p in self._listed if p.box.intersect(box) is not None]
        if box.empty:
            return []
        ranges = [
            range(o // c, -(-(o + n) // c))
            for o, n, c in zip(box.offsets, box.lengths, self.chunks, strict=True)
        ]
        coords = list(itertools.product(*ranges))
        linear = [self._linear(c) for c in coords]
        first, end = min(linear), max(linear) + 1
        crcs, sizes = self.crc.span(first, end), self.size.span(first, end)
        return [
            self._piece(c, int(crcs[k - first]), int(sizes[k - first]))
            for c, k in zip(coords, linear, strict=True)
        ]

    def _linear(self, coord: tuple[int, ...]) -> int:
        k = 0
        for i, n in zip(coord, self.grid, strict=True):
            k = k * n + i
        return k

    def _piece(
        self, coord: tuple[int, ...], crc: int | None = None, size: int | None = None
    ) -> StoredPiece:
        if crc is None or size is None:
            k = self._linear(coord)
            crc, size = self.crc[k], self.size[k]
        offsets = tuple([i * c for i, c in zip(coord, self.chunks)])
        lengths = tuple([min(c, n - o) for o, c, n in zip(offsets, self.chunks, self.shape)])
        piece = StoredPiece(
            f"{self.path}/{zarr_meta.chunk_key(coord)}",
            Box.known(offsets, lengths),
            self.chunks,
            self.inner,
            crc,
            size,
            self.codec,
        )
        return piece.check(self.variable, self.shape, self.itemsize)


def read_index(checkpoint: str | os.PathLike[str] | Store) -> dict[str, Any]:
    """The index of a committed checkpoint, checked for format and version."""
    store = resolve(checkpoint)
    return parse_index(read_index_bytes(store), store)


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


def parse_index(raw: bytes, store: Store) -> Index:
    """The index in ``raw`` (the root ``zarr.json`` of ``store``), checked for format and
    version."""
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
    checked = Index(index, version_of(raw))
    for name, entry in index["variables"].items():
        try:
            check_entry(entry, name, made=checked.pieces)
        except CheckpointError as exc:
            raise type(exc)(f"{store.url}: {exc}") from None
    return checked


class Index(dict[str, Any]):
    """A parsed and checked index document; ``pieces`` holds the :class:`Pieces` made
    while checking its tensor entries (by ``id`` of the entry, which the document keeps
    alive), so that a reader does not parse them again (:func:`pieces_of`); ``version``
    names the bytes it was read from (:func:`version_of`)."""

    def __init__(self, doc: dict[str, Any], version: str | None = None) -> None:
        super().__init__(doc)
        self.pieces: dict[int, Pieces] = {}
        self.version = version


def version_of(raw: bytes) -> str:
    """A name of an index document's bytes: equal bytes, equal names."""
    return f"{_crc32c.crc32c(raw):08x}-{len(raw)}"


def pieces_of(index: dict[str, Any], entry: dict[str, Any], variable: str) -> Pieces:
    """The stored pieces of ``entry``, a tensor entry of ``index``: made when the index
    was checked, else now."""
    made = index.pieces.get(id(entry)) if isinstance(index, Index) else None
    return made if made is not None else Pieces(entry, variable)


def check_entry(
    entry: Any, variable: str, *, located: bool = True, made: dict[int, Pieces] | None = None
) -> None:
    """Check one entry of an index's variables table, so that every reader can trust its
    kind, dtype, shape, pieces and value (see :mod:`distckpt.storage.wellformed`);
    ``located=False``: the entry names no pieces (the node-local tier's). Raises
    :class:`CorruptCheckpointError` naming ``variable``; ``made`` collects the
    :class:`Pieces` made."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "tensor":
        if located:
            pieces = Pieces(entry, variable)
            if made is not None:
                made[id(entry)] = pieces
        else:
            wellformed.shape_of(entry, variable, stored_dtype(entry, variable).itemsize)
    elif kind == "value" and "value" in entry:
        values.check(entry["value"], variable)
    elif kind == "per_rank" and isinstance(entry.get("ranks"), dict):
        for rank, sub in entry["ranks"].items():
            if not (rank.isascii() and rank.isdigit()):
                raise wellformed.corrupt(variable, f"a per-rank entry of rank {rank!r:.60}")
            if not isinstance(sub, dict) or sub.get("kind") == "per_rank":
                raise wellformed.corrupt(variable, f"malformed entry of rank {rank}")
            check_entry(sub, variable, located=located, made=made)
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

"""What an index entry says is stored: a tensor's pieces, in either form the index
writes them (listed one by one, or compact columns of a regular array: see
:mod:`distckpt.format.index` for the document), checked before any use."""

from __future__ import annotations

import base64
import dataclasses
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.errors import (
    CorruptCheckpointError,
    UnsupportedValueError,
)
from distckpt.format import codecs, digests, wellformed, zarr_meta
from distckpt.signing import hashes
from distckpt.slices import Box, grid_points
from distckpt.tiling import TilingProblem, tiling_problem

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
    #: A signed save's hash of the piece's stored bytes (:mod:`distckpt.signing`).
    hash: bytes | None = None

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
        if self.hash is not None:
            doc["hash"] = self.hash.hex()
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
            digest=_hex(data.get("digest"), digests.PIECE_BYTES, variable, "digest"),
            reused=_origin(data.get("reused"), variable),
            hash=_hex(data.get("hash"), hashes.HASH_BYTES, variable, "hash"),
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
            self.hash is not None,
        )
        return self


def _hex(value: Any, width: int, variable: str, what: str) -> bytes | None:
    """A listed piece's ``digest`` or ``hash``: absent, or ``width`` bytes in hex."""
    if value is None:
        return None
    if isinstance(value, str) and len(value) == 2 * width:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise wellformed.corrupt(
        variable, f"a piece {what} that is not {2 * width} hex digits: {value!r:.60}"
    )


def _origin(value: Any, variable: str) -> str | None:
    """Where a piece was reused from (shown, never opened): a short printable string."""
    if value is None:
        return None
    if isinstance(value, str) and 0 < len(value) <= 4096 and value.isprintable():
        return value
    raise wellformed.corrupt(variable, f"a piece's origin that is not a name: {value!r:.60}")


def untiled(problem: TilingProblem, pieces: list[StoredPiece]) -> str:
    """Why ``pieces`` do not tile their variable's shape (``problem``), naming their files."""
    shape = list(problem.within.lengths)
    if problem.kind == "overlap":
        (a, b), (i, j) = problem.boxes, problem.which
        both = f"both hold {a}" if a == b else f"{a} and {b} share {a.intersect(b)}"
        what = f"pieces {pieces[i].file} and {pieces[j].file} overlap: {both}"
    elif problem.kind == "gap":
        what = f"no piece covers {problem.boxes[0]}"
    else:
        what = str(problem)
    return f"its pieces do not tile its shape {shape} exactly once: {what}"


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


#: What a base64 column may hold (checked without decoding it).
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


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
            if not _BASE64.fullmatch(data):  # its alphabet now; its bytes when a rank reads them
                raise self._error("is not base64")
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
    hash: np.ndarray | None = None,
) -> dict[str, Any]:
    """The index entry of a regular array (``crc``, ``size``, ``digest``, ``hash``: by
    shard, C order; ``reused``: from :func:`reuse_column`)."""
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
    if hash is not None:
        entry["hash"] = column(hash)
    return entry


class Pieces:
    """The stored pieces of one tensor entry of the index, in either form: compact
    (a regular entry: ``chunks``, ``crc``, ``size``) or listed (``pieces``). Checked on
    construction: a malformed entry raises :class:`CorruptCheckpointError`, an unknown
    codec :class:`UnsupportedFormatError`, naming ``variable``. Listed pieces must tile
    the shape exactly once (:func:`~distckpt.tiling.tiling_problem`; a regular grid does
    by construction), so that every reader that fills a tensor from them fills all of it;
    ``tiling=False`` leaves that to the caller (``distckpt verify`` reports it)."""

    def __init__(self, entry: Any, variable: str, *, tiling: bool = True) -> None:
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
            problem = (
                tiling_problem([p.box for p in self._listed], Box.full(shape)) if tiling else None
            )
            if problem is not None:
                raise wellformed.corrupt(variable, untiled(problem, self._listed))
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
        self._reused = entry.get("reused")
        self._hash = entry.get("hash")
        self._rows_cache: dict[str, np.ndarray] = {}
        if self._digest is not None:  # malformed: corrupt now, not when first asked
            self._rows("digest", digests.PIECE_BYTES)
        if self._hash is not None:
            self._rows("hash", hashes.HASH_BYTES)
        if self._reused is not None:
            self._reuse_rows(count)

    def __len__(self) -> int:
        return len(self._listed) if self._listed is not None else self.crc.count

    def _rows(self, name: str, width: int) -> np.ndarray:
        """A column of ``width``-byte rows (``digest``, ``hash``), decoded once."""
        cached = self._rows_cache.get(name)
        if cached is not None:
            return cached
        count = len(self)
        data = self._digest if name == "digest" else self._hash
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
            raise wellformed.corrupt(self.variable, f"the index's {name} column is malformed")
        rows = self._rows_cache[name] = np.frombuffer(raw, np.uint8).reshape(count, width)
        return rows

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
        digest = None
        if self._digest is not None:
            digest = self._rows("digest", digests.PIECE_BYTES)[k].tobytes()
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
        return [row.tobytes() for row in self._rows("digest", digests.PIECE_BYTES)]

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
        coords = grid_points([range(n) for n in self.grid])  # (none when one is empty)
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
        """The pieces that hold part of ``box`` (global coordinates; none when it is of
        another rank than the shape): for a regular entry found by arithmetic on the grid,
        so a rank's read plan costs what it reads, and at most the pieces stored."""
        if box.ndim != len(self.shape):
            return []
        if self._listed is not None:
            return [p for p in self._listed if p.box.intersect(box) is not None]
        inside = box.intersect(Box.full(self.shape))  # a grid's cells beyond it are none
        if inside is None:
            return []
        ranges = [
            range(o // c, -(-(o + n) // c))
            for o, n, c in zip(inside.offsets, inside.lengths, self.chunks, strict=True)
        ]
        coords = list(grid_points(ranges))  # (as many as the column holds, at most)
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
        piece_hash = None
        if self._hash is not None:
            piece_hash = self._rows("hash", hashes.HASH_BYTES)[self._linear(coord)].tobytes()
        piece = StoredPiece(
            f"{self.path}/{zarr_meta.chunk_key(coord)}",
            Box.known(offsets, lengths),
            self.chunks,
            self.inner,
            crc,
            size,
            self.codec,
            hash=piece_hash,
        )
        return piece.check(self.variable, self.shape, self.itemsize)

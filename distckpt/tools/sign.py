"""``distckpt sign``: sign a committed checkpoint after the fact.

A checkpoint saved without a key has no hash tables in its shards
(:mod:`distckpt.format.shard_io`). Signing it writes a signed copy and puts it in the
checkpoint's place as an overwriting save does (:mod:`distckpt.commit.transaction`: a
staging directory exchanged with the checkpoint on a file system), so the checkpoint is
never half signed and a failure leaves it as it was; on an object store, where no whole
checkpoint can take another's place at once, the signed copy goes to a new location
(``out``):

* each shard is rewritten with its hash table (the chunks' stored bytes are copied, each
  checked against its crc32c first; nothing is decompressed or re-encoded); a shard that
  already has one (a signed checkpoint signed again) is copied, every chunk checked
  against its hash;
* plain chunks and every other file are copied as they are (a hard link where the store
  can), plain chunks checked against their crc32c;
* the index gets every piece's hash and size, the hashes of the ``zarr.json`` files, and
  the signature.

A damaged piece stops the signing (:class:`~distckpt.errors.CorruptCheckpointError`):
a signature vouches only for bytes that were checked.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt.commit.transaction import begin
from distckpt.engine.commit import index_bytes
from distckpt.errors import CheckpointError
from distckpt.format import zarr_meta
from distckpt.format.index import FORMAT_VERSION, Index, parse_index, pieces_of, read_index_bytes
from distckpt.format.piece_reader import PieceReader
from distckpt.format.shard_io import EMPTY, crc32c, inner_grid
from distckpt.format.stored import StoredPiece, column
from distckpt.signing import hashes, signature, trust
from distckpt.signing.keys import SigningKey
from distckpt.slices import Box
from distckpt.storage.backend import Store, copying
from distckpt.storage.registry import open_store

#: Bytes copied at a time (the chunks of a shard between its tables and its index).
STEP = 8 << 20


@dataclass
class SignReport:
    """What :func:`sign` did."""

    signer: str
    algorithm: str
    pieces: int = 0
    bytes_read: int = 0


def sign(
    path: str | os.PathLike[str] | Store,
    key: SigningKey,
    *,
    out: str | os.PathLike[str] | Store | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> SignReport:
    """Sign the committed checkpoint at ``path`` with ``key`` (see the module docstring),
    in its place, or as a new checkpoint at ``out`` (which must not hold one). In place
    needs a store that renames (a file system): an object store cannot put a whole
    checkpoint in another's place at once, so there a signed copy goes to ``out``.
    ``on_bytes(n)`` reports the bytes read (they add up to the pieces' sizes)."""
    store = open_store(path)
    target = store if out is None else open_store(out)
    if out is None and not store.capabilities.renames:
        raise CheckpointError(
            f"{store.url}: signing in place needs a store that renames (a file system); "
            "write a signed copy to another location (distckpt sign CKPT --out NEW)"
        )
    index = parse_index(read_index_bytes(store), store)
    stated = index.get(trust.ALGORITHM)
    algorithm = stated if isinstance(stated, str) else hashes.default_algorithm()
    hashes.hasher(algorithm)  # (a checkpoint hashed with one this process lacks: refused)
    report = SignReport(key.id, algorithm)
    txn = begin(target, secrets.token_hex(8), 1, overwrite=out is None)
    try:
        copy = _SignedCopy(store, txn.root, algorithm, report, on_bytes)
        copy.root.prepare([key for key, _size, _age in store.walk("")])  # its directories
        signed = copy.index(index)
        groups = _copy_other_files(store, copy.root, index, signed)
        txn.commit(groups, index_bytes(signed, key))
    except BaseException:
        txn.abort()
        raise
    return report


@dataclass
class _SignedCopy:
    """The signed copy being written into ``root`` from ``store``: each piece checked,
    hashed with ``algorithm`` and copied or rewritten (counted in ``report``)."""

    store: Store
    root: Store
    algorithm: str
    report: SignReport
    on_bytes: Callable[[int], None] | None

    def index(self, index: Index) -> dict[str, Any]:
        """The index of the signed copy, every piece copied or rewritten."""
        doc = {k: v for k, v in index.items() if k not in (signature.MEMBER, "checksum")}
        variables: dict[str, Any] = {}
        for name, entry in index["variables"].items():
            if entry.get("kind") == "per_rank":
                ranks = {r: self.entry(index, name, sub) for r, sub in entry["ranks"].items()}
                variables[name] = {**entry, "ranks": ranks}
            else:
                variables[name] = self.entry(index, name, entry)
        doc["variables"] = variables
        doc["format_version"] = FORMAT_VERSION
        doc[trust.ALGORITHM] = self.algorithm
        return doc

    def entry(self, index: Index, name: str, entry: dict[str, Any]) -> dict[str, Any]:
        """One variable's entry, its pieces with their new sizes and hashes."""
        if entry.get("kind") != "tensor":
            return dict(entry)
        pieces = pieces_of(index, entry, name)
        signed = [self.piece(name, piece, pieces.itemsize) for piece in pieces]
        out = dict(entry)
        if "chunks" in entry:  # a regular entry: columns
            out["size"] = column(np.array([size for size, _ in signed], dtype=np.uint64))
            rows = b"".join(h for _, h in signed)
            out["hash"] = column(np.frombuffer(rows, np.uint8).reshape(len(signed), -1))
        else:
            out["pieces"] = [
                {**p.to_json(), "size": size, "hash": h.hex()}
                for p, (size, h) in zip(pieces, signed, strict=True)
            ]
        return out

    def piece(self, name: str, piece: StoredPiece, itemsize: int) -> tuple[int, bytes]:
        """Copy or rewrite one piece; its stored size and hash."""
        self.report.pieces += 1
        self.report.bytes_read += piece.size
        if piece.box.empty:
            return piece.size, hashes.digest(self.algorithm)
        wide = itemsize in (1, 2, 4, 8)
        dtype = np.dtype(f"u{itemsize}") if wide else np.dtype((np.void, itemsize))
        auth = None if piece.hash is None else (self.algorithm, piece.hash)
        reader = PieceReader(
            name, self.store, piece.file, dtype, piece.crc, piece.codec, piece.size, auth
        )
        if piece.inner is None:
            out = np.empty(piece.box.lengths, dtype=dtype)
            reader.read_plain(piece.block, Box.full(piece.box.lengths), out)  # crc (and hash)
            _copy(self.store, self.root, piece.file)
            raw = self.root.read(piece.file)
            self._read(len(raw))
            return len(raw), hashes.digest(self.algorithm, raw)
        return self.rewrite_shard(reader, piece)

    def _read(self, n: int) -> None:
        if self.on_bytes is not None:
            self.on_bytes(n)

    def rewrite_shard(self, reader: PieceReader, piece: StoredPiece) -> tuple[int, bytes]:
        """Write ``piece``'s shard with a hash table: its checksum table, the hash of every
        chunk's stored bytes, the chunks where they were (moved by the table's size), and
        its index with the offsets moved; every chunk is checked as it is read."""
        assert piece.inner is not None
        n = math.prod(inner_grid(piece.block, piece.inner))
        fd = reader.open()
        try:
            header = reader.header(fd, piece.block, piece.inner)
            shift = 0 if header.hashes is not None else n * hashes.HASH_BYTES
            head = header.head
            data_end = header.size - (n * 16 + 4)
            rows = np.zeros((n, hashes.HASH_BYTES), np.uint8)
            index = header.index.copy()
            for k in range(n):
                offset, length = (int(v) for v in header.index[k])
                if offset == EMPTY:
                    continue
                if offset < head or length < 4 or offset + length > data_end:
                    raise reader._corrupt(f"inner chunk {k} lies outside the shard's data")
                chunk_hash = _checked_hash(reader, fd, header, k, self.algorithm)
                rows[k] = np.frombuffer(chunk_hash, np.uint8)
                index[k] = (offset + shift, length)
            table = header.table.astype("<u4").tobytes()
            index_raw = index.astype("<u8").tobytes()
            tail = index_raw + struct.pack("<I", crc32c(index_raw))
            handle = self.root.create(piece.file, header.size + shift)
            try:
                handle.write([table, rows.tobytes()], 0)
                _copy_range(fd, handle, head, data_end, shift)
                handle.write([tail], data_end + shift)
                handle.finish(True)
            except BaseException:
                handle.abort()
                raise
        finally:
            fd.close()
        self._read(header.size)
        return header.size + shift, hashes.digest(self.algorithm, table, rows.tobytes(), tail)


def _checked_hash(reader: PieceReader, fd: Any, header: Any, k: int, algorithm: str) -> bytes:
    """The hash of inner chunk ``k``'s stored bytes, once they pass their crc32c (and the
    hash the shard records, when it has one)."""
    offset, length = (int(v) for v in header.index[k])
    stored = fd.read(offset, length)
    if len(stored) != length:
        raise reader._corrupt(f"inner chunk {k} is truncated")
    crc = int.from_bytes(stored[-4:], "little")
    if crc != int(header.table[k]) or crc32c(stored[:-4]) != crc:
        raise reader._corrupt(f"inner chunk {k} fails its crc32c checksum")
    found = hashes.digest(algorithm, stored)
    want = header.hash_of(k)
    if want is not None and want != found:
        raise reader._untrusted(f"inner chunk {k}")
    return found


def _copy_range(fd: Any, handle: Any, start: int, end: int, shift: int) -> None:
    for at in range(start, end, STEP):
        data = fd.read(at, min(STEP, end - at))
        handle.write([data], at + shift)


def _copy(store: Store, root: Store, key: str) -> None:
    """``key`` of ``store`` copied into ``root`` (a hard link where the store can)."""
    target = copying(root)
    if target is not None:
        target.copy(store, key, key)
    else:
        root.write(key, store.read(key))


def _copy_other_files(
    store: Store, root: Store, index: Index, signed: dict[str, Any]
) -> dict[str, bytes]:
    """Copy the arrays' ``zarr.json`` and any file that is neither a piece nor metadata
    (those a framework puts beside its checkpoint); record the hash of every
    ``zarr.json`` in ``signed``; return the groups' ``zarr.json`` for the commit."""
    pieces = _piece_files(index)
    algorithm = signed[trust.ALGORITHM]
    groups: dict[str, bytes] = {}
    files: dict[str, str] = {}
    for key, _size, _age in store.walk(""):
        if key == zarr_meta.ZARR_JSON or key in pieces:
            continue
        if key.endswith("/" + zarr_meta.ZARR_JSON):
            raw = store.read(key)
            files[key] = hashes.digest(algorithm, raw).hex()
            if _is_group(raw):
                groups[key] = raw
                continue
        _copy(store, root, key)
    signed[trust.FILES] = dict(sorted(files.items()))
    return groups


def _is_group(raw: bytes) -> bool:
    try:
        return bool(json.loads(raw).get("node_type") == "group")
    except (ValueError, AttributeError):
        return False


def _piece_files(index: Index) -> set[str]:
    found: set[str] = set()
    for name, entry in index["variables"].items():
        subs = entry.get("ranks", {}).values() if entry.get("kind") == "per_rank" else [entry]
        for sub in subs:
            if sub.get("kind") == "tensor":
                found.update(p.file for p in pieces_of(index, sub, name))
    return found


__all__ = ["SignReport", "sign"]

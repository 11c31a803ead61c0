"""Content digests of stored pieces: what decides that a piece is unchanged.

An incremental save (:mod:`distckpt.engine.reuse`) reuses a piece of the checkpoint it
builds on only when the bytes it would store are those stored there, as a strong hash
of both says; a tensor's version counter, its identity or a timestamp never decide.

* An inner chunk's digest is the BLAKE3 hash (256 bits) of its raw bytes as a shard
  stores them before any compression: C order, zeros padding a chunk at the edge of the
  array (:func:`distckpt.storage.shard_io.stored_chunk`).
* A sharded piece's digest is the first 128 bits of the BLAKE3 hash of its chunks'
  digests, in the order of the shard index; a plain chunk's, of its raw bytes. The codec,
  dtype, block and inner chunk shape are compared separately, as the index records them.

The digests are computed where the bytes pass anyway: by the I/O workers, beside the
crc32c, as each chunk is written or, for a piece that may be reused, read once to decide.
BLAKE3 runs at several GB/s a core and releases the GIL, so the workers hash in parallel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import blake3

#: Bytes of a piece's digest as the index records it.
PIECE_BYTES = 16


def chunk_digest(raw: Any) -> bytes:
    """The digest of one inner chunk's raw bytes (a flat uint8 array or buffer)."""
    return blake3.blake3(raw).digest()


def piece_digest(chunks: Iterable[bytes]) -> bytes:
    """The digest of a sharded piece from its chunks' digests, in shard-index order."""
    hasher = blake3.blake3()
    for digest in chunks:
        hasher.update(digest)
    return hasher.digest(PIECE_BYTES)


def plain_digest(raw: Any) -> bytes:
    """The digest of a plain chunk's raw bytes."""
    return blake3.blake3(raw).digest(PIECE_BYTES)

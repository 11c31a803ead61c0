"""Content digests of stored pieces: what decides that a piece is unchanged.

An incremental save (:mod:`distckpt.engine.reuse`) reuses a piece of the checkpoint it
builds on only when the bytes it would store are those stored there, as a digest of both
says; a tensor's version counter, its identity or a timestamp never decide.

* An inner chunk's digest is the 128-bit XXH3 hash of its raw bytes as a shard stores
  them before any compression: C order, zeros padding a chunk at the edge of the array
  (:func:`distckpt.format.shard_io.stored_chunk`).
* A sharded piece's digest is the XXH3-128 hash of its chunks' digests, in the order of
  the shard index; a plain chunk's, of its raw bytes. The codec, dtype, block and inner
  chunk shape are compared separately, as the index records them.

Why XXH3-128 (:data:`ALGORITHM`, recorded in the index): two different pieces share a
digest with a chance of 2**-128, far below that of an undetected memory or disk error,
and it hashes at memory speed (about 27 GB/s a core here), so deciding that a gigabyte
is unchanged costs a few hundredths of a second. A cryptographic hash (BLAKE3, 4 GB/s a
core here) would be six times slower and guard against nothing more: the only party able
to aim at a digest is one that can write the base checkpoint, and that party can write
any digest it likes into the base's index (see :mod:`distckpt.engine.reuse` for what is
checked against the base's files instead).

The digests are computed where the bytes pass anyway: by the I/O workers, beside the
crc32c, as each chunk is written or, for a piece that may be reused, read once to decide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import xxhash

#: The digest algorithm, as an index names it (``"digests"``): a base whose digests were
#: made otherwise is not built on.
ALGORITHM = "xxh3-128"
#: Bytes of a digest (a chunk's and a piece's).
PIECE_BYTES = 16


def chunk_digest(raw: Any) -> bytes:
    """The digest of one inner chunk's raw bytes (a flat uint8 array or buffer)."""
    return xxhash.xxh3_128_digest(raw)


def piece_digest(chunks: Iterable[bytes]) -> bytes:
    """The digest of a sharded piece from its chunks' digests, in shard-index order."""
    return xxhash.xxh3_128_digest(b"".join(chunks))


def plain_digest(raw: Any) -> bytes:
    """The digest of a plain chunk's raw bytes."""
    return xxhash.xxh3_128_digest(raw)

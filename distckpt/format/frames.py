"""Checking a compressed inner chunk's frame before any decoder sees it. Pure: no I/O.

A crc32c proves that the stored bytes are the ones written, not that whoever wrote them
meant well: an attacker who can write a checkpoint recomputes it. The decoders trust
their frame's header: c-blosc reads as far as the header's compressed size says, whatever
the buffer's length (a lying size reads outside it and kills the process), and a zstd
or blosc frame that declares fewer bytes than the chunk holds decodes "successfully"
into the first few bytes of the output, leaving the rest as it was (the target's old
values, or another chunk's in a reused scratch buffer).

So every frame is checked against what is stored (its length) and what is expected (the
inner chunk's raw size) first, and decoded only if it passes:

* **zstd** (RFC 8878): one frame, no dictionary, its content size declared and equal to
  the chunk's size, its blocks walked header by header (each of a known type and at most
  128 KiB) to end exactly where the stored bytes end, and no larger than zstd's own
  compress bound. zstd then refuses to produce any other number of bytes than the
  declared content size, and numcodecs compares what it produced with that size.
* **blosc** (c-blosc 1.x format 2): the header's version and flags, its element size and
  shuffle the codec's, its raw size equal to the chunk's, its compressed size equal to
  the stored length, a block size that divides
  the raw size into blocks whose start table fits, and every block start and every
  split's compressed length inside the stored bytes, as c-blosc itself walks them. Every
  block then decodes to exactly its size or c-blosc fails, so the whole output is
  written.

A frame that fails raises :class:`FrameError` (a ``ValueError``) saying what lies.
"""

from __future__ import annotations

import struct

import numpy as np

ZSTD_MAGIC = 0xFD2FB528
#: zstd's largest block (of content), whatever the window.
ZSTD_BLOCK_MAX = 128 << 10
BLOSC_VERSION = 2
BLOSC_HEADER = 16
#: blosc's compressor codes (the flags' top 3 bits) by cname.
BLOSC_CODES = {"blosclz": 0, "lz4": 1, "lz4hc": 1, "snappy": 2, "zlib": 3, "zstd": 4}
_BLOSC_MEMCPYED, _BLOSC_FUTURE, _BLOSC_DONT_SPLIT = 0x02, 0x08, 0x10
#: The header's shuffle bits (byte shuffle 0x01, bit shuffle 0x04) by the codec's shuffle.
_BLOSC_SHUFFLES = 0x05
_BLOSC_SHUFFLE_FLAGS = {"noshuffle": 0x00, "shuffle": 0x01, "bitshuffle": 0x04}
#: c-blosc splits a block into ``typesize`` streams only for a type of at most this size
#: and blocks of at least MIN_BUFFERSIZE elements (blosc.c).
_BLOSC_MAX_SPLITS, _BLOSC_MIN_BUFFERSIZE = 16, 128
_BLOSC_HEAD = struct.Struct("<BBBBiii")
_INT32 = struct.Struct("<i")
_INT32S = [struct.Struct(f"<{n}i") for n in range(257)]  # block start tables


class FrameError(ValueError):
    """A compressed frame whose header does not fit what is stored or expected."""


def zstd_bound(size: int) -> int:
    """zstd's ZSTD_COMPRESSBOUND: the largest frame zstd makes of ``size`` bytes."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small


def check_zstd(stored: np.ndarray, expected: int) -> None:
    """Raise :class:`FrameError` unless ``stored`` (flat uint8) is one zstd frame that
    decompresses to ``expected`` bytes and ends where the stored bytes end."""
    data = stored.reshape(-1).data
    size = len(data)
    if size > zstd_bound(expected) + 32:  # (+ the frame header and checksum)
        raise FrameError(f"a zstd frame of {size} bytes for {expected} bytes of content")
    if size < 6 or int.from_bytes(data[:4], "little") != ZSTD_MAGIC:
        raise FrameError("not a zstd frame (no magic number)")
    descriptor = data[4]
    fcs_flag, single, reserved = descriptor >> 6, descriptor >> 5 & 1, descriptor >> 3 & 1
    checksum, did_flag = descriptor >> 2 & 1, descriptor & 3
    if reserved:
        raise FrameError("a zstd frame header with its reserved bit set")
    if did_flag:
        raise FrameError("a zstd frame that needs a dictionary")
    at = 5 + (0 if single else 1)  # the window descriptor, when not a single segment
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if not fcs_size:
        raise FrameError("a zstd frame that does not declare its content size")
    if at + fcs_size > size:
        raise FrameError("a zstd frame header cut short")
    content = int.from_bytes(data[at : at + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if content != expected:
        raise FrameError(f"a zstd frame of {content} bytes of content, expected {expected}")
    at += fcs_size
    known = 0  # bytes the raw and run-length blocks make
    blocks = 0
    while True:
        if at + 3 > size:
            raise FrameError("a zstd frame whose blocks run past the stored bytes")
        header = int.from_bytes(data[at : at + 3], "little")
        last, kind, length = header & 1, header >> 1 & 3, header >> 3
        at += 3
        blocks += 1
        if kind == 3:
            raise FrameError("a zstd block of the reserved type")
        if length > ZSTD_BLOCK_MAX:
            raise FrameError(f"a zstd block of {length} bytes (at most {ZSTD_BLOCK_MAX})")
        if kind == 1:  # run-length: one byte, repeated ``length`` times
            known += length
            at += 1
        else:
            known += length if kind == 0 else 0
            at += length
        if last:
            break
    at += 4 if checksum else 0
    if at != size:
        raise FrameError(f"a zstd frame that ends at byte {at} of {size} stored")
    if known > expected or blocks * ZSTD_BLOCK_MAX < expected:
        raise FrameError(f"zstd blocks that cannot make {expected} bytes")


def check_blosc(
    stored: np.ndarray, expected: int, cname: str, typesize: int = 1, shuffle: str = "noshuffle"
) -> None:
    """Raise :class:`FrameError` unless ``stored`` (flat uint8) is one blosc frame of
    compressor ``cname``, element size ``typesize`` and ``shuffle`` (the codec's, which
    c-blosc writes into the header as given) that decompresses to ``expected`` bytes, all
    of whose block starts and split lengths lie inside the stored bytes. (A header's
    element size or shuffle decides how the bytes are put back in order: one that another
    writer changed would give other values from the same checked streams.)"""
    size = stored.nbytes
    if size < BLOSC_HEADER:
        raise FrameError(f"a blosc frame of {size} bytes (its header alone is 16)")
    if size > expected + BLOSC_HEADER:  # blosc stores a block raw rather than grow it
        raise FrameError(f"a blosc frame of {size} bytes for {expected} bytes of content")
    data = stored.reshape(-1).data
    version, _, flags, stored_type, nbytes, blocksize, cbytes = _BLOSC_HEAD.unpack_from(data)
    if version != BLOSC_VERSION:
        raise FrameError(f"a blosc frame of format version {version}")
    if flags & _BLOSC_FUTURE:
        raise FrameError("a blosc frame with flags from the future")
    if nbytes != expected:
        raise FrameError(f"a blosc frame of {nbytes} bytes of content, expected {expected}")
    if cbytes != size:
        raise FrameError(f"a blosc frame that says it is {cbytes} bytes, stored in {size}")
    if not 0 < blocksize <= max(nbytes, 1):
        raise FrameError(f"a blosc frame of block size {blocksize}")
    if stored_type != (typesize if typesize <= 255 else 1):
        raise FrameError(f"a blosc frame of elements of {stored_type} bytes, not {typesize}")
    if flags & _BLOSC_SHUFFLES != _BLOSC_SHUFFLE_FLAGS.get(shuffle, -1):
        raise FrameError(f"a blosc frame whose shuffle flags {flags & 5:#x} are not {shuffle}'s")
    if flags & _BLOSC_MEMCPYED:
        if cbytes != nbytes + BLOSC_HEADER:
            raise FrameError("a blosc frame stored raw whose size is not its content's")
        return
    if flags >> 5 != BLOSC_CODES.get(cname, -1):
        raise FrameError(f"a blosc frame of compressor code {flags >> 5}, not {cname}'s")
    nblocks = -(-nbytes // blocksize)
    table_end = BLOSC_HEADER + 4 * nblocks
    if table_end > size:
        raise FrameError(f"a blosc frame of {nblocks} blocks whose start table does not fit")
    # Each block is ``splits`` streams, each a 4-byte length and that many bytes (the
    # last block, when shorter, is one stream), walked as c-blosc walks them.
    splits = (
        stored_type
        if not flags & _BLOSC_DONT_SPLIT
        and stored_type <= _BLOSC_MAX_SPLITS
        and blocksize // stored_type >= _BLOSC_MIN_BUFFERSIZE
        else 1
    )
    last_splits = 1 if nbytes % blocksize else splits
    if nblocks * splits <= 256:  # the usual few blocks: cheaper one by one
        starts = _INT32S[nblocks].unpack_from(data, BLOSC_HEADER)
        for block, at in enumerate(starts):
            if not table_end <= at <= size - 4:
                raise FrameError("a blosc block that starts outside the stored bytes")
            for _ in range(last_splits if block == nblocks - 1 else splits):
                if at > size - 4:
                    raise FrameError("a blosc stream that starts outside the stored bytes")
                (length,) = _INT32.unpack_from(data, at)
                at += 4 + length
                if length < 0 or at > size:
                    raise FrameError("a blosc stream that runs past the stored bytes")
        return
    _walk_blosc_blocks(stored, nblocks, table_end, splits, last_splits)


def _walk_blosc_blocks(
    stored: np.ndarray, nblocks: int, table_end: int, splits: int, last_splits: int
) -> None:
    """:func:`check_blosc`'s walk of the streams, vectorised over many blocks."""
    size = stored.nbytes
    starts = stored[BLOSC_HEADER:table_end].view("<i4").astype(np.int64)
    if starts.min() < table_end or starts.max() > size - 4:
        raise FrameError("a blosc block that starts outside the stored bytes")
    count = np.full(nblocks, splits, dtype=np.int64)
    count[-1] = last_splits
    at = starts
    for k in range(splits):
        walking = count > k
        where = at[walking]
        if where.max() > size - 4:
            raise FrameError("a blosc stream that starts outside the stored bytes")
        lengths = np.zeros(nblocks, dtype=np.int64)
        lengths[walking] = stored[where[:, None] + np.arange(4)].view("<i4").reshape(-1)
        at = at + np.where(walking, 4 + lengths, 0)
        if (lengths < 0).any() or at.max() > size:
            raise FrameError("a blosc stream that runs past the stored bytes")

"""Writing a ``torch.save`` file a slab at a time, without holding its tensors.

``torch.save`` writes a zip archive: the pickle (``data.pkl``), a few small records, then
one record ``data/<k>`` of raw bytes per storage, storages numbered in the order the
pickle meets them. Under ``torch.serialization.skip_data`` (torch 2.6 and later) it
writes the same archive with each storage record's room left empty, "to be populated in
a separate pass". :func:`save_skeleton` does that for a state whose tensors are
:func:`placeholder`\\ s (memory reserved, never touched); :func:`storage_records` finds
each storage record's bytes in the file, and :func:`fill` writes them, slab after slab,
and sets the record's crc32 (in its data descriptor and in the central directory) as
``torch.save`` would have. The file is then the one ``torch.save`` writes for the
filled-in tensors, byte for byte, but for ``.data/serialization_id``, which ``torch.save``
draws anew for every file.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from distckpt.storage.posix_io import pwrite_all

_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_FULL = 0xFFFFFFFF


def supported() -> bool:
    """Whether this torch writes archives with room for storages (``skip_data``)."""
    return hasattr(torch.serialization, "skip_data")


def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` whose memory is reserved but never
    written or read (so it is never resident): :func:`save_skeleton` reads only what it
    is, not what it holds."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    strides: list[int] = []
    count = 1
    for n in reversed(shape):
        strides.insert(0, count)
        count *= n
    storage = torch.UntypedStorage(count * itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), tuple(strides))


def save_skeleton(state: dict[str, Any], f: IO[bytes]) -> None:
    """``torch.save(state, f)`` with every storage's bytes left to :func:`fill`."""
    with torch.serialization.skip_data():  # type: ignore[attr-defined]
        torch.save(state, f)


@dataclass(frozen=True)
class Record:
    """Where a storage's bytes go in the archive, and where its crc32 is kept."""

    name: str
    offset: int
    size: int
    crc_at: tuple[int, ...]


class LayoutError(ValueError):
    """The archive is not laid out as :func:`storage_records` knows ``torch.save``'s."""


def storage_records(fd: int) -> list[Record]:
    """The ``data/<k>`` records of the archive open at ``fd``, in order of ``k``."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, 22, size - 22)
    if len(tail) != 22 or tail[:4] != _EOCD:
        raise LayoutError("no end of central directory record where torch.save puts it")
    entries, start = struct.unpack_from("<H", tail, 10)[0], struct.unpack_from("<I", tail, 16)[0]
    if entries == 0xFFFF or start == _FULL:  # zip64: the locator stands before the record
        locator = os.pread(fd, 20, size - 42)
        if locator[:4] != _ZIP64_LOCATOR:
            raise LayoutError("no zip64 locator")
        at = struct.unpack_from("<Q", locator, 8)[0]
        record = os.pread(fd, 56, at)
        if record[:4] != _ZIP64_EOCD:
            raise LayoutError("no zip64 end of central directory record")
        entries, start = (
            struct.unpack_from("<QQ", record, 32)[0],
            struct.unpack_from("<Q", record, 48)[0],
        )
    records: dict[int, Record] = {}
    at = start
    for _ in range(entries):
        fixed = os.pread(fd, 46, at)
        if fixed[:4] != _CENTRAL:
            raise LayoutError(f"no central directory entry at byte {at}")
        flags = struct.unpack_from("<H", fixed, 8)[0]
        usize, n, m, k = struct.unpack_from("<IHHH", fixed, 24)
        csize = struct.unpack_from("<I", fixed, 20)[0]
        local = struct.unpack_from("<I", fixed, 42)[0]
        name = os.pread(fd, n, at + 46).decode("utf-8")
        usize, local = _zip64(os.pread(fd, m, at + 46 + n), usize, csize, local)
        key = name.rsplit("/data/", 1)[-1] if "/data/" in name else ""
        if key.isascii() and key.isdigit():
            header = os.pread(fd, 30, local)
            if header[:4] != _LOCAL or struct.unpack_from("<H", header, 8)[0] != 0:
                raise LayoutError(f"{name}: not a stored (uncompressed) record")
            ln, lm = struct.unpack_from("<HH", header, 26)
            offset = local + 30 + ln + lm
            crc_at = [at + 16]
            if flags & 8:  # a data descriptor follows the bytes
                if os.pread(fd, 4, offset + usize) != _DESCRIPTOR:
                    raise LayoutError(f"{name}: no data descriptor after its bytes")
                crc_at.append(offset + usize + 4)
            else:
                crc_at.append(local + 14)
            records[int(key)] = Record(name, offset, usize, tuple(crc_at))
        at += 46 + n + m + k
    if sorted(records) != list(range(len(records))):
        raise LayoutError(f"storage records numbered {sorted(records)}")
    return [records[k] for k in range(len(records))]


def _zip64(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int]:
    """The sizes and offset of a central directory entry, from its zip64 extra field
    where the entry holds 0xFFFFFFFF."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            if usize == _FULL:
                usize = values.pop(0)
            if csize == _FULL:
                values.pop(0)
            if local == _FULL:
                local = values.pop(0)
        at += 4 + length
    return usize, local


def fill(fd: int, record: Record, slabs: Iterable[np.ndarray]) -> int:
    """Write the flat uint8 ``slabs``, one after the other, as ``record``'s bytes, and
    its crc32 where the archive keeps it. Returns the bytes written."""
    offset, crc = record.offset, 0
    for slab in slabs:
        view = slab.reshape(-1).view(np.uint8).data
        offset += pwrite_all(fd, [view], offset)
        crc = zlib.crc32(view, crc)
    written = offset - record.offset
    if written != record.size:
        raise LayoutError(f"{record.name}: {written} bytes for a record of {record.size}")
    for at in record.crc_at:
        os.pwrite(fd, struct.pack("<I", crc), at)
    return written

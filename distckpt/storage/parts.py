"""An object written at offsets, cut into the fixed-size parts of a multipart upload
(:class:`~distckpt.storage.object_io.ObjectWriter`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from distckpt.storage.backend import Buffer, byte_view

#: The smallest part of S3, GCS and Azure multipart uploads (but for the last).
MIN_PART = 5 << 20
#: The most parts distckpt makes of one object (S3 and GCS allow 10,000, Azure 50,000).
MAX_PARTS = 9_000


def part_size(wanted: int, size_hint: int | None) -> int:
    """The part size for an object of about ``size_hint`` bytes: ``wanted``, at least
    :data:`MIN_PART`, and whole MiB large enough that it takes at most :data:`MAX_PARTS`."""
    part = max(wanted, MIN_PART)
    if size_hint:
        part = max(part, math.ceil(size_hint / MAX_PARTS / (1 << 20)) << 20)
    return part


def cut(
    buffers: Sequence[Buffer], offset: int, part_bytes: int
) -> Iterator[tuple[int, int, memoryview]]:
    """``(part, offset within it, bytes)`` for each stretch of ``buffers`` written one
    after another from ``offset`` that falls in one part of ``part_bytes``."""
    for b in buffers:
        view = byte_view(b)
        at = 0
        while at < view.nbytes:
            part, within = divmod(offset + at, part_bytes)
            take = min(view.nbytes - at, part_bytes - within)
            yield part, within, view[at : at + take]
            at += take
        offset += view.nbytes

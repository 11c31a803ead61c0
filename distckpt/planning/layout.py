"""How a variable's boxes are laid out in zarr: regular grids, inner chunk sizes.

Pure arithmetic over boxes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from distckpt.slices import Box


def regular_grid(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...] | None:
    """The chunk shape if ``boxes`` (distinct, non-empty) tile ``shape`` as a regular grid.

    A regular grid is what zarr can store as one array: per dimension equal pieces, the last
    possibly shorter (``torch.chunk`` and DTensor's uneven shards are regular). Returns None
    for any other partition, including one that overlaps or leaves gaps.
    """
    if not boxes:
        return None
    chunk: list[int] = []
    counts: list[int] = []
    for d, n in enumerate(shape):
        intervals = sorted({(b.offsets[d], b.lengths[d]) for b in boxes})
        size = intervals[0][1]
        expected_start = 0
        for i, (start, length) in enumerate(intervals):
            last = i == len(intervals) - 1
            if start != expected_start or (length != size and not last) or length > size:
                return None
            expected_start = start + length
        if expected_start != n:
            return None
        chunk.append(size)
        counts.append(len(intervals))
    if len(set(boxes)) != len(boxes) or len(boxes) != math.prod(counts):
        return None
    return tuple(chunk)


def inner_chunks(block: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """An inner chunk shape that divides ``block`` and holds at most about ``target_bytes``.

    Splits the leading dimensions first, so inner chunks of a row-major block are contiguous
    runs of memory that can be written and read without copying.
    """
    inner = list(block)
    for d in range(len(inner)):
        rest = math.prod(inner[d + 1 :]) * itemsize
        if inner[d] * rest <= target_bytes:
            break
        fit = max(1, target_bytes // max(rest, 1))
        inner[d] = _largest_divisor_at_most(block[d], fit)
        if inner[d] > 1 or rest <= target_bytes:
            break
    return tuple(inner)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for q in (i, n // i):
                if best < q <= limit:
                    best = q
        i += 1
    return best

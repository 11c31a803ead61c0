"""Proving that boxes tile a box exactly once: every element in exactly one box, none
outside. Whatever claims to cover a tensor (a checkpoint's listed pieces, a local step's
boxes, the ranks' slices of a save, a read plan's copies) is proven with
:func:`tiling_problem`, never by adding up element counts (an overlap hides a gap of
the same size). Pure: no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt.slices import Box

#: Cells (of the grid that the boxes' starts and ends cut) up to which
#: :func:`tiling_problem` counts the boxes on every cell: a few MiB of counters.
GRID_CELLS = 1 << 21
#: Corners (boxes times 2 ** dimensions cut) up to which it adds up signed corners.
CORNER_POINTS = 1 << 22
#: Pairs of boxes whose ranges meet in one dimension up to which it compares them.
PAIR_BUDGET = 1 << 25
_FEW = 8  # boxes compared pair by pair (a read plan's few copies)
_PAIR_STEP = 1 << 20  # pairs compared at once


@dataclass(frozen=True)
class TilingProblem:
    """Why boxes do not tile ``within`` exactly once. ``kind``: ``"outside"`` (``boxes[0]``
    is not inside ``within``), ``"overlap"`` (the two ``boxes`` share elements; equal:
    one box listed twice), ``"gap"`` (no box covers ``boxes[0]``, part of ``within``) or
    ``"unproven"`` (too large or irregular to settle in bounded time). ``which``: where
    ``boxes`` are in the sequence given (none for a gap)."""

    kind: str
    within: Box
    boxes: tuple[Box, ...] = ()
    which: tuple[int, ...] = ()
    note: str = ""

    def __str__(self) -> str:
        if self.kind == "outside":
            return f"box {self.boxes[0]} lies outside {self.within}"
        if self.kind == "overlap":
            a, b = self.boxes
            if a == b:
                return f"box {a} is listed twice"
            return f"boxes {a} and {b} overlap in {a.intersect(b)}"
        if self.kind == "gap":
            return f"no box covers {self.boxes[0]} of {self.within}"
        return self.note


def tiling_problem(boxes: Sequence[Box], within: Box) -> TilingProblem | None:
    """None if ``boxes`` tile ``within`` exactly once (every element of ``within`` in
    exactly one box, none outside it; empty boxes are ignored), else why not, with an
    example. Pure; milliseconds for thousands of boxes::

        >>> print(tiling_problem([Box((0,), (5,)), Box((2,), (3,))], Box.full((8,))))
        boxes [0:5] and [2:5] overlap in [2:5]
        >>> print(tiling_problem([Box((0,), (5,))], Box.full((8,))))
        no box covers [5:8] of [0:8]

    Exact: the boxes' starts and ends cut each dimension into a grid of cells. A grid of
    up to :data:`GRID_CELLS` cells is painted, each box adding one to its cells: every
    count must be one. Beyond, the boxes' signed corners (the counts differenced along
    every dimension) must add up to those of ``within`` alone; failing that, or with too
    many corners, boxes whose ranges meet along the dimension where fewest pairs do are
    compared (disjoint boxes inside ``within`` tile it when their volumes add up to its
    own). A ``within`` of ``2**62`` elements or more (no stored tensor) is "unproven".
    """
    ndim = within.ndim
    if within.empty:  # nothing to prove, however long its other dimensions
        for k, b in enumerate(boxes):
            if b.ndim != ndim or not b.empty:
                return TilingProblem("outside", within, (b,), (k,))
        return None
    if within.numel >= 1 << 62 or any(e >= 1 << 62 for e in within.ends):
        note = f"{within} holds too many elements to prove what tiles it (2**62 or more)"
        return TilingProblem("unproven", within, note=note)
    m = len(boxes)
    if m <= _FEW:
        return _few(boxes, within)
    try:
        starts, sizes = [b.offsets for b in boxes], [b.lengths for b in boxes]
        if {*map(len, starts), *map(len, sizes)} != {ndim}:
            return _first_outside(boxes, within)
        chain = itertools.chain.from_iterable
        offs = np.fromiter(chain(starts), np.int64, m * ndim).reshape(m, ndim)
        lens = np.fromiter(chain(sizes), np.int64, m * ndim).reshape(m, ndim)
    except OverflowError:  # far outside
        return _first_outside(boxes, within)
    keep = np.flatnonzero(np.all(lens > 0, axis=1))
    offs, lens = offs[keep], lens[keep]
    lo, hi = np.array(within.offsets, np.int64), np.array(within.ends, np.int64)
    outside = np.any((offs < lo) | (offs > hi) | (lens > hi - offs), axis=1)
    if outside.any():
        k = int(keep[int(np.argmax(outside))])
        return TilingProblem("outside", within, (boxes[k],), (k,))
    ends = offs + lens
    if len(keep) == 0:
        return TilingProblem("gap", within, (within,))
    # Dimensions that every box spans whole play no part.
    cut = [d for d in range(ndim) if np.any(offs[:, d] != lo[d]) or np.any(ends[:, d] != hi[d])]
    found = _settle(offs[:, cut], ends[:, cut], lo[cut], hi[cut])
    if found is None:
        return None
    kind, (a, b) = found
    if kind == "overlap":
        i, j = int(keep[int(a)]), int(keep[int(b)])
        return TilingProblem(kind, within, (boxes[i], boxes[j]), (i, j))
    if kind == "gap":
        gap_lo, gap_hi = lo.copy(), hi.copy()
        gap_lo[cut], gap_hi[cut] = a, b
        return _gap_problem(within, gap_lo, gap_hi)
    verb = "do not tile" if kind == "miscounted" else "are too irregular to prove that they tile"
    return TilingProblem("unproven", within, note=f"{len(keep)} boxes {verb} {within} exactly once")


def _few(boxes: Sequence[Box], within: Box) -> TilingProblem | None:
    kept = [(k, b) for k, b in enumerate(boxes) if b.ndim != within.ndim or not b.empty]
    for k, b in kept:
        if b.ndim != within.ndim or not within.contains(b):
            return TilingProblem("outside", within, (b,), (k,))
    for x, (j, a) in enumerate(kept):
        for k, b in kept[x + 1 :]:
            if a.intersect(b) is not None:
                return TilingProblem("overlap", within, (a, b), (j, k))
    if sum(b.numel for _, b in kept) == within.numel:
        return None
    shape = (len(kept), within.ndim)
    offs = np.array([b.offsets for _, b in kept], np.int64).reshape(shape)
    ends = np.array([b.ends for _, b in kept], np.int64).reshape(shape)
    lo, hi = _gap(offs, ends, np.array(within.offsets, np.int64), np.array(within.ends, np.int64))
    return _gap_problem(within, lo, hi)


def _first_outside(boxes: Sequence[Box], within: Box) -> TilingProblem:
    for k, b in enumerate(boxes):
        if len(b.offsets) != within.ndim or b.ndim != within.ndim:
            return TilingProblem("outside", within, (b,), (k,))
        if not b.empty and not within.contains(b):
            return TilingProblem("outside", within, (b,), (k,))
    raise ValueError(f"boxes of {within} that NumPy cannot hold")  # (never: all fit int64)


def _gap_problem(within: Box, lo: np.ndarray, hi: np.ndarray) -> TilingProblem:
    gap = Box(tuple(lo.tolist()), tuple((hi - lo).tolist()))
    return TilingProblem("gap", within, (gap,))


def _settle(o: np.ndarray, e: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> Any:
    """Whether non-empty boxes (starts ``o``, ends ``e``, cut along every dimension)
    inside ``[lo, hi)`` tile it: None, ``("overlap", (i, j))``, ``("gap", (lo, hi))``,
    or ``("miscounted" | "unproven", (None, None))``."""
    m, s = o.shape
    if s == 0:  # every box is the whole
        return None if m == 1 else ("overlap", (0, 1))
    cuts = [
        _distinct(np.concatenate([lo[j : j + 1], hi[j : j + 1], o[:, j], e[:, j]]))
        for j in range(s)
    ]
    io = np.stack([np.searchsorted(c, o[:, j]) for j, c in enumerate(cuts)], axis=1)
    ie = np.stack([np.searchsorted(c, e[:, j]) for j, c in enumerate(cuts)], axis=1)
    sizes = tuple(len(c) for c in cuts)
    corners = m << s <= CORNER_POINTS and sum(int(n).bit_length() for n in sizes) <= 62
    if math.prod(sizes) <= GRID_CELLS:
        found = _painted(io, ie, sizes, corners)
        if found is None or found[0] == "overlap":
            return found
        cell = found[1]
        lows = np.array([c[k] for c, k in zip(cuts, cell)])
        return "gap", (lows, np.array([c[k + 1] for c, k in zip(cuts, cell)]))
    if corners and _corners_match(io, ie, sizes):
        return None
    pair, complete = _overlapping_pair(o, e)
    if pair is not None:
        return "overlap", pair
    if not complete:
        return ("miscounted" if corners else "unproven"), (None, None)
    volume = sum(np.prod(e - o, axis=1).tolist())  # Python ints: no overflow
    if volume == math.prod((hi - lo).tolist()):
        return None
    return "gap", _gap(o, e, lo, hi)


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (by sorting: np.unique hashes, slower here)."""
    ordered = np.sort(values)
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]


def _corner_indices(
    io: np.ndarray, ie: np.ndarray, sizes: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Every box's corners as flat indices into an array of ``sizes``: those that add
    one, and those that take one away (an odd number of ends)."""
    plus: list[np.ndarray] = []
    minus: list[np.ndarray] = []
    for corner in itertools.product((0, 1), repeat=io.shape[1]):
        at = tuple(np.where(c, ie[:, j], io[:, j]) for j, c in enumerate(corner))
        (minus if sum(corner) % 2 else plus).append(np.ravel_multi_index(at, sizes))
    return np.concatenate(plus), np.concatenate(minus)


def _painted(io: np.ndarray, ie: np.ndarray, sizes: tuple[int, ...], corners: bool) -> Any:
    """Paint the grid: None, ``("overlap", (i, j))`` or ``("gap", cell)``."""
    grid = tuple(n - 1 for n in sizes)
    if corners:
        plus, minus = _corner_indices(io, ie, sizes)
        size = math.prod(sizes)
        diff = np.bincount(plus, minlength=size) - np.bincount(minus, minlength=size)
        diff = diff.reshape(sizes)
        for axis in range(len(sizes)):
            np.cumsum(diff, axis=axis, out=diff)
        counts = diff[tuple(slice(0, n) for n in grid)]
    else:  # box by box, stopping at the first overlap: at most every cell twice
        counts = np.zeros(grid, np.int64)
        for a, b in zip(io.tolist(), ie.tolist(), strict=True):
            region = counts[tuple(slice(x, y) for x, y in zip(a, b))]
            if region.any():
                at = np.unravel_index(int(np.argmax(region.reshape(-1))), region.shape)
                counts[tuple(x + y for x, y in zip(a, at))] += 2
                break
            region += 1
    flat = counts.reshape(-1)
    over = np.flatnonzero(flat > 1)
    if over.size:
        cell = np.array(np.unravel_index(int(over[0]), grid))
        holders = np.flatnonzero(np.all((io <= cell) & (ie > cell), axis=1))
        return "overlap", (int(holders[0]), int(holders[1]))
    empty = np.flatnonzero(flat == 0)
    if empty.size:
        return "gap", [int(k) for k in np.unravel_index(int(empty[0]), grid)]
    return None


def _corners_match(io: np.ndarray, ie: np.ndarray, sizes: tuple[int, ...]) -> bool:
    """Whether the boxes' signed corners add up to those of the whole grid alone: then
    every cell is counted once (the counts are the corners summed along every axis)."""
    plus, minus = _corner_indices(io, ie, sizes)
    # Sorted as one array (a corner's key doubled, plus one if it adds): the runs of
    # equal values count each corner's additions and removals.
    marked = np.sort(np.concatenate([plus * 2 + 1, minus * 2]))
    heads = np.flatnonzero(np.concatenate([[True], marked[1:] != marked[:-1]]))
    runs = np.diff(np.append(heads, len(marked)))
    values = marked[heads]
    signed = np.where(values & 1, runs, -runs)
    keys = values >> 1
    heads = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    net = np.add.reduceat(signed, heads)
    left = net != 0
    whole_lo, whole_hi = np.zeros((1, len(sizes)), np.int64), np.array([[n - 1 for n in sizes]])
    want_plus, want_minus = _corner_indices(whole_lo, whole_hi, sizes)
    want = sorted([(int(k), 1) for k in want_plus] + [(int(k), -1) for k in want_minus])
    return want == list(zip(keys[heads][left].tolist(), net[left].tolist(), strict=True))


def _overlapping_pair(o: np.ndarray, e: np.ndarray) -> tuple[tuple[int, int] | None, bool]:
    """Two boxes that overlap, if any, and whether every pair that might was compared
    (not when that would pass :data:`PAIR_BUDGET`). Sweeps the dimension along which the
    fewest pairs of ranges meet."""
    m, s = o.shape
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for j in range(s):
        order = np.argsort(o[:, j], kind="stable")
        # Boxes after each (by start) that start before it ends.
        reach = np.searchsorted(o[order, j], e[order, j], side="left") - np.arange(1, m + 1)
        total = int(reach.sum())
        if best is None or total < best[0]:
            best = (total, order, reach)
    assert best is not None
    total, order, reach = best
    if total > PAIR_BUDGET:
        return None, False
    so, se = o[order], e[order]
    done = np.cumsum(reach)
    first = 0
    while first < m:
        base = int(done[first - 1]) if first else 0
        last = max(first + 1, int(np.searchsorted(done, base + _PAIR_STEP, side="right")))
        counts = reach[first:last]
        n = int(counts.sum())
        if n:
            a = np.repeat(np.arange(first, last), counts)
            b = a + 1 + np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
            hit = np.all(np.maximum(so[a], so[b]) < np.minimum(se[a], se[b]), axis=1)
            if hit.any():
                h = int(np.argmax(hit))
                x, y = sorted((int(order[a[h]]), int(order[b[h]])))
                return (x, y), True
        first = last
    return None, True


def _gap(
    o: np.ndarray, e: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A box of ``[lo, hi)`` that no box covers, given disjoint boxes inside it that
    cover less than all of it: the first slab along dimension 0 that they cover less of
    than its cross-section, and in it (recursively) a gap of that cross-section."""
    if len(o) == 0 or len(lo) == 0:
        return lo, hi
    cuts = _distinct(np.concatenate([lo[:1], hi[:1], o[:, 0], e[:, 0]]))
    cross = np.prod(e[:, 1:] - o[:, 1:], axis=1)
    covered = np.zeros(len(cuts), np.int64)
    np.add.at(covered, np.searchsorted(cuts, o[:, 0]), cross)
    np.add.at(covered, np.searchsorted(cuts, e[:, 0]), -cross)
    short = np.flatnonzero(np.cumsum(covered)[:-1] < math.prod((hi[1:] - lo[1:]).tolist()))
    k = int(short[0])
    start, end = cuts[k], cuts[k + 1]
    spans = (o[:, 0] <= start) & (e[:, 0] >= end)
    rest_lo, rest_hi = _gap(o[spans, 1:], e[spans, 1:], lo[1:], hi[1:])
    return np.concatenate([[start], rest_lo]), np.concatenate([[end], rest_hi])

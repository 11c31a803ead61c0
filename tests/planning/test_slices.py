"""Slice specs: TensorFlow's shape_and_slice text form, intersection, torch.chunk bounds;
the proof that boxes tile a box exactly once."""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest
import torch

from distckpt import tiling
from distckpt.slices import Box, SliceSpec, chunk_bounds, grid_points
from distckpt.tiling import tiling_problem


@pytest.mark.parametrize(
    ("text", "shape", "offsets", "lengths"),
    [
        ("10 20 0,5:-", (10, 20), (0, 0), (5, 20)),
        ("10 20 -:3,7", (10, 20), (0, 3), (10, 7)),
        ("4 -", (4,), (0,), (4,)),
        ("7 2,5", (7,), (2,), (5,)),
        ("", (), (), ()),
    ],
)
def test_parse_and_print_round_trip(text, shape, offsets, lengths):
    spec = SliceSpec.parse(text)
    assert spec.shape == shape
    assert spec.offsets == offsets
    assert spec.lengths == lengths
    assert str(spec) == text
    assert SliceSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "text", ["10 20 0,5", "10 x 0,5:-", "10 20 0,5:a,b", "10 20 8,5:-", "10 20 0,5:-:-"]
)
def test_parse_rejects_bad_text(text):
    with pytest.raises(ValueError):
        SliceSpec.parse(text)


def test_intersection():
    a = SliceSpec.parse("10 20 0,5:-")
    b = SliceSpec.parse("10 20 3,5:4,4")
    both = a.intersect(b)
    assert both is not None and str(both) == "10 20 3,2:4,4"
    assert a.intersect(SliceSpec.parse("10 20 5,5:-")) is None
    with pytest.raises(ValueError):
        a.intersect(SliceSpec.parse("10 21 -:-"))


def test_box_geometry():
    outer = Box((2, 4), (6, 6))
    inner = Box((3, 5), (2, 2))
    assert outer.contains(inner) and not inner.contains(outer)
    assert inner.relative_to(outer) == Box((1, 1), (2, 2))
    assert Box.from_json(inner.to_json()) == inner
    assert Box((), ()).intersect(Box((), ())) == Box((), ())
    assert Box((0,), (0,)).empty
    with pytest.raises(ValueError):
        Box((0, 0), (1,))


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 10, 16])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_chunk_bounds_match_torch_chunk(length, parts):
    pieces = torch.arange(length).chunk(parts) if length else ()
    expected = []
    start = 0
    for p in pieces:
        expected.append((start, len(p)))
        start += len(p)
    got = [chunk_bounds(length, parts, i) for i in range(parts)]
    assert [g for g in got if g[1] > 0] == [e for e in expected if e[1] > 0]
    assert sum(n for _, n in got) == length


# ---------------------------------------------------------------- tiling


def b(offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Box:
    return Box(offsets, lengths)


WHOLE = Box.full((8,))


@pytest.mark.parametrize(
    ("boxes", "within", "kind", "text"),
    [
        ([b((0,), (8,))], WHOLE, None, ""),
        ([b((0,), (5,)), b((5,), (3,))], WHOLE, None, ""),
        ([b((0,), (5,)), b((2,), (3,))], WHOLE, "overlap", "[0:5] and [2:5] overlap in [2:5]"),
        ([b((0,), (5,)), b((5,), (3,)), b((0,), (5,))], WHOLE, "overlap", "[0:5] is listed twice"),
        ([b((0,), (5,))], WHOLE, "gap", "no box covers [5:8] of [0:8]"),
        ([b((0,), (2,)), b((5,), (3,))], WHOLE, "gap", "no box covers [2:5]"),
        ([], WHOLE, "gap", "no box covers [0:8]"),
        ([b((6,), (3,)), b((0,), (6,))], WHOLE, "outside", "box [6:9] lies outside [0:8]"),
        ([b((0, 0), (8, 1))], WHOLE, "outside", "outside"),
        # empty boxes are ignored, wherever they are
        ([b((0,), (8,)), b((3,), (0,)), b((40,), (0,))], WHOLE, None, ""),
        # 0-d: one box is the whole; two overlap; none leaves it uncovered
        ([b((), ())], Box((), ()), None, ""),
        ([b((), ()), b((), ())], Box((), ()), "overlap", "listed twice"),
        ([], Box((), ()), "gap", "no box covers []"),
        # a shape with an empty dimension is tiled by nothing, and by empty boxes
        ([], Box.full((3, 0)), None, ""),
        ([b((0, 0), (3, 0))], Box.full((3, 0)), None, ""),
        # a box of another origin
        ([b((2, 2), (2, 3)), b((4, 2), (1, 3))], Box((2, 2), (3, 3)), None, ""),
        ([b((2, 2), (2, 3)), b((4, 3), (1, 2))], Box((2, 2), (3, 3)), "gap", "[4:5, 2:3]"),
    ],
)
def test_tiling_of_hand_built_boxes(
    boxes: list[Box], within: Box, kind: str | None, text: str
) -> None:
    for few in (tiling._FEW, 0):  # pair by pair, and as arrays
        problem = tiling_problem(boxes, within) if few else _as_arrays(boxes, within)
        assert (problem and problem.kind) == kind, (few, problem)
        assert text in str(problem)
        if problem is not None and problem.which:
            assert tuple(boxes[k] for k in problem.which) == problem.boxes


def _as_arrays(boxes: list[Box], within: Box) -> tiling.TilingProblem | None:
    saved = tiling._FEW
    tiling._FEW = 0
    try:
        return tiling_problem(boxes, within)
    finally:
        tiling._FEW = saved


def _brute(boxes: list[Box], within: Box) -> str | None:
    if any(not x.empty and not within.contains(x) for x in boxes):
        return "outside"
    counts = np.zeros(within.lengths, np.int64)
    for x in boxes:
        if not x.empty:
            counts[x.relative_to(within).slices()] += 1
    if (counts > 1).any():
        return "overlap"
    return "gap" if (counts == 0).any() else None


def _guillotine(lo: list[int], hi: list[int], rng: random.Random, depth: int = 0) -> list[Box]:
    """A random partition of ``[lo, hi)`` by cuts across one dimension at a time."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if not dims or depth > 5 or rng.random() < 0.25:
        return [Box(tuple(lo), tuple(h - x for x, h in zip(lo, hi, strict=True)))]
    d = rng.choice(dims)
    at = rng.randrange(lo[d] + 1, hi[d])
    return _guillotine(lo, [*hi[:d], at, *hi[d + 1 :]], rng, depth + 1) + _guillotine(
        [*lo[:d], at, *lo[d + 1 :]], hi, rng, depth + 1
    )


def _damaged(boxes: list[Box], rng: random.Random) -> list[Box]:
    boxes = list(boxes)
    what = rng.random()
    k = rng.randrange(len(boxes))
    if what < 0.2:
        boxes.pop(k)
    elif what < 0.35:
        boxes.append(boxes[k])
    elif what < 0.6:
        x = boxes[k]
        boxes[k] = Box(
            tuple(max(0, v + rng.randrange(-1, 2)) for v in x.offsets),
            tuple(max(0, v + rng.randrange(-1, 2)) for v in x.lengths),
        )
    rng.shuffle(boxes)
    return boxes


@pytest.mark.parametrize(
    "path",
    [
        {},  # pair by pair when few, else the painted grid
        {"_FEW": 0},
        {"_FEW": 0, "CORNER_POINTS": 0},  # the grid painted box by box
        {"_FEW": 0, "GRID_CELLS": 0},  # signed corners, then pairs for an example
        {"_FEW": 0, "GRID_CELLS": 0, "CORNER_POINTS": 0},  # pairs and volumes
        {"_FEW": 0, "GRID_CELLS": 0, "PAIR_BUDGET": 4},  # corners, no example
        {"_FEW": 0, "GRID_CELLS": 0, "CORNER_POINTS": 0, "PAIR_BUDGET": 4},  # unproven
    ],
)
def test_tiling_agrees_with_counting_every_element(
    path: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in path.items():
        monkeypatch.setattr(tiling, name, value)
    rng = random.Random(32)
    kinds = set()
    for _ in range(800):
        ndim = rng.randrange(0, 4)
        within = Box(
            tuple(rng.randrange(0, 3) for _ in range(ndim)),
            tuple(rng.randrange(0, 7) for _ in range(ndim)),
        )
        boxes = _guillotine(list(within.offsets), list(within.ends), rng)
        if rng.random() < 0.7:
            boxes = _damaged(boxes, rng)
        want = _brute(boxes, within)
        problem = tiling_problem(boxes, within)
        kinds.add(want)
        if problem is not None and problem.kind == "unproven":
            assert want is not None or "irregular" in str(problem), boxes
            continue
        assert (problem and problem.kind) == want or (
            want == "outside" and problem is not None  # an overlap may be found first
        ), (boxes, within, problem)
        if problem is None:
            continue
        if problem.kind == "overlap":
            x, y = problem.boxes
            assert problem.which[0] != problem.which[1] and x.intersect(y) is not None
        if problem.kind == "gap":
            (gap,) = problem.boxes
            assert within.contains(gap) and not gap.empty
            assert all(x.empty or x.intersect(gap) is None for x in boxes), (gap, boxes)
    assert kinds == {None, "overlap", "gap", "outside"}


def _fastest(
    boxes: list[Box], within: Box, tries: int = 5
) -> tuple[float, tiling.TilingProblem | None]:
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        problem = tiling_problem(boxes, within)
        best = min(best, time.perf_counter() - t0)
    return best, problem


def _flat_shards(rows: int, cols: int, parts: int) -> list[Box]:
    """The boxes of a C-order flat ``[rows, cols]`` split in ``parts`` runs (as FSDP does):
    a partial row, whole rows, a partial row."""
    out = []
    bounds = [rows * cols * k // parts for k in range(parts + 1)]
    for a, z in zip(bounds, bounds[1:], strict=False):
        (r0, c0), (r1, c1) = divmod(a, cols), divmod(z, cols)
        if r0 == r1:
            out.append(Box((r0, c0), (1, c1 - c0)))
            continue
        if c0:
            out.append(Box((r0, c0), (1, cols - c0)))
            r0 += 1
        if r1 > r0:
            out.append(Box((r0, 0), (r1 - r0, cols)))
        if c1:
            out.append(Box((r1, 0), (1, c1)))
    return out


def test_tiling_of_thousands_of_boxes_is_fast() -> None:
    """Plans at scale: 8,192 pieces of one variable, split along any dimension, proven in
    milliseconds (the bounds leave room for a busy machine), and no case quadratic."""
    n = 8192
    rng = random.Random(5)
    cuts = [0, *sorted(rng.sample(range(1, 10**6), n - 1)), 10**6]
    cases = {  # name: boxes, within, seconds
        "dim 0": ([Box((3 * i, 0), (3, 4096)) for i in range(n)], Box.full((3 * n, 4096)), 0.05),
        "dim 1": ([Box((0, 3 * i), (4096, 3)) for i in range(n)], Box.full((4096, 3 * n)), 0.05),
        "uneven, dim 1 of 3": (
            [Box((0, a, 0), (2, z - a, 5)) for a, z in zip(cuts, cuts[1:], strict=False)],
            Box.full((2, 10**6, 5)),
            0.05,
        ),
        "a 91 x 90 grid": (
            [Box((10 * i, 7 * j), (10, 7)) for i in range(91) for j in range(90)],
            Box.full((910, 630)),
            0.05,
        ),
        # every piece's rows and columns cut apart: far too many cells to paint
        "flat shards": (_flat_shards(5000, 7919, n), Box.full((5000, 7919)), 0.2),
    }
    for name, (boxes, within, bound) in cases.items():
        rng.shuffle(boxes)
        took, problem = _fastest(boxes, within)
        assert problem is None, (name, problem)
        assert took < bound, (name, took)
        took, problem = _fastest([*boxes, boxes[n // 2]], within, 2)
        assert problem is not None and problem.kind == "overlap", (name, problem)
        assert problem.boxes == (boxes[n // 2],) * 2 and took < 4 * bound, (name, took)
        took, problem = _fastest(boxes[:-1], within, 2)
        assert problem is not None and problem.kind == "gap", (name, problem)
        assert problem.boxes[0].intersect(boxes[-1]) is not None, (name, problem)
        assert took < 4 * bound, (name, took)


def test_tiling_too_irregular_to_settle_in_bounded_time_is_a_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tiling, "GRID_CELLS", 0)
    monkeypatch.setattr(tiling, "CORNER_POINTS", 0)
    monkeypatch.setattr(tiling, "PAIR_BUDGET", 2)
    boxes = [Box((i, 0), (1, 8)) for i in range(8)] + [Box((8, 0), (8, 8))]
    problem = tiling_problem([x for x in boxes for x in _split_cols(x)], Box.full((16, 8)))
    assert problem is not None and problem.kind == "unproven"
    assert "too irregular" in str(problem)


def _split_cols(x: Box) -> list[Box]:
    return [Box(x.offsets, (x.lengths[0], 4)), Box((x.offsets[0], 4), (x.lengths[0], 4))]


def test_tiling_refuses_a_box_beyond_what_it_can_count() -> None:
    problem = tiling_problem([Box.full((1 << 40, 1 << 30))], Box.full((1 << 40, 1 << 30)))
    assert problem is not None and problem.kind == "unproven" and "too many" in str(problem)


def test_grid_points_holds_a_point_at_a_time() -> None:
    """``itertools.product``'s points, in its order; but an empty range beside one of
    2**40 is no point (not a tuple of 2**40 ints first), and the first point of a huge
    grid costs what one point does."""
    rng = random.Random(7)
    for _ in range(200):
        ranges = [range(rng.randrange(3), rng.randrange(3, 7)) for _ in range(rng.randrange(4))]
        assert list(grid_points(ranges)) == list(itertools.product(*ranges))
    big = [range(3), range(70_000), range(2)]  # beyond the eager bound: walked lazily
    assert list(itertools.islice(grid_points(big), 5)) == list(
        itertools.islice(itertools.product(*big), 5)
    )
    started = time.perf_counter()
    assert list(grid_points([range(2**40), range(0)])) == []
    assert next(grid_points([range(2**40)] * 64)) == (0,) * 64
    assert list(grid_points([])) == [()]
    assert time.perf_counter() - started < 1


def test_an_empty_box_tiles_with_no_piece_whatever_its_other_dimensions() -> None:
    within = Box.full((0, 2**62, 2**62))  # beyond what is proven for boxes of elements
    assert tiling_problem([], within) is None
    assert tiling_problem([Box((0, 0, 0), (0, 5, 5))], within) is None
    problem = tiling_problem([Box((0, 0, 0), (1, 1, 1))], within)
    assert problem is not None and problem.kind == "outside"

"""Slice specs: TensorFlow's shape_and_slice text form, intersection, torch.chunk bounds."""

from __future__ import annotations

import pytest
import torch

from distckpt.slices import Box, SliceSpec, chunk_bounds


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

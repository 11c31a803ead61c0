"""Slice specs: which box of a global tensor a rank holds.

A :class:`SliceSpec` is a global shape plus, per dimension, a start and a length. Its text
form is TensorFlow's ``shape_and_slice`` string: the global shape, a space, then one
``start,length`` per dimension separated by ``:``, with ``-`` for a whole dimension::

    >>> spec = SliceSpec.parse("10 20 0,5:-")
    >>> spec.offsets, spec.lengths
    ((0, 0), (5, 20))
    >>> str(spec)
    '10 20 0,5:-'

Everything here is pure arithmetic: no I/O, no communication.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import EllipsisType


@dataclass(frozen=True, order=True)
class Box:
    """An axis-aligned box: ``offsets[d] <= i < offsets[d] + lengths[d]`` in every dimension."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(
                f"box offsets {self.offsets} and lengths {self.lengths} differ in rank"
            )
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise ValueError(f"box with negative offset or length: {self.offsets}, {self.lengths}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(int(n) for n in shape))

    @classmethod
    def known(cls, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Box:
        """A box from tuples of ints already known valid (derived from valid boxes),
        without checking them again: read planning makes millions."""
        box = object.__new__(cls)
        object.__setattr__(box, "offsets", offsets)
        object.__setattr__(box, "lengths", lengths)
        return box

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def empty(self) -> bool:
        return any(n == 0 for n in self.lengths)

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they do not overlap."""
        starts = []
        lengths = []
        for a, n, b, m in zip(
            self.offsets, self.lengths, other.offsets, other.lengths, strict=True
        ):
            start = a if a > b else b
            end = min(a + n, b + m)
            if end <= start:
                return None
            starts.append(start)
            lengths.append(end - start)
        return Box.known(tuple(starts), tuple(lengths))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        offsets = tuple([o - b for o, b in zip(self.offsets, outer.offsets, strict=True)])
        if offsets and min(offsets) < 0:
            raise ValueError(f"box {self} is not inside {outer}")
        return Box.known(offsets, self.lengths)

    def slices(self) -> tuple[slice | EllipsisType, ...]:
        """Index selecting this box, as a view, from an array whose origin is the box's frame.

        Ends with ``...`` so a 0-d box selects a 0-d view rather than a scalar copy.
        """
        return (*(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True)), ...)

    def shifted(self, origin: Sequence[int]) -> Box:
        """This box moved by ``origin`` (from a frame at ``origin`` into the outer one)."""
        return Box(tuple(o + b for o, b in zip(self.offsets, origin, strict=True)), self.lengths)

    def contains(self, other: Box) -> bool:
        return all(
            so <= oo and oo + on <= so + sn
            for so, sn, oo, on in zip(
                self.offsets, self.lengths, other.offsets, other.lengths, strict=True
            )
        )

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.lengths)]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[int]]) -> Box:
        return cls(tuple(int(v) for v in data[0]), tuple(int(v) for v in data[1]))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


@dataclass(frozen=True)
class SliceSpec:
    """A global shape and the box of it that one rank holds."""

    shape: tuple[int, ...]
    box: Box

    def __post_init__(self) -> None:
        if len(self.shape) != self.box.ndim:
            raise ValueError(f"slice {self.box} does not fit a tensor of rank {len(self.shape)}")
        if not Box.full(self.shape).contains(self.box):
            raise ValueError(f"slice {self.box} lies outside the global shape {list(self.shape)}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> SliceSpec:
        shape = tuple(int(n) for n in shape)
        return cls(shape, Box.full(shape))

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.box.offsets

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.box.lengths

    def intersect(self, other: SliceSpec) -> SliceSpec | None:
        if self.shape != other.shape:
            raise ValueError(f"slices of different shapes {self.shape} and {other.shape}")
        common = self.box.intersect(other.box)
        return None if common is None else SliceSpec(self.shape, common)

    @classmethod
    def parse(cls, text: str) -> SliceSpec:
        """Parse TensorFlow's ``shape_and_slice`` form, e.g. ``"10 20 0,5:-"``."""
        parts = text.split()
        if not parts:  # a scalar: TensorFlow writes the empty string
            return cls((), Box((), ()))
        try:
            *dims, slice_text = parts
            shape = tuple(int(d) for d in dims)
        except ValueError:
            raise ValueError(f"bad shape in shape_and_slice {text!r}") from None
        pieces = slice_text.split(":")
        if len(pieces) != len(shape):
            raise ValueError(
                f"shape_and_slice {text!r}: {len(pieces)} slice parts for {len(shape)} dims"
            )
        offsets, lengths = [], []
        for dim, piece in zip(shape, pieces, strict=True):
            if piece == "-":
                offsets.append(0)
                lengths.append(dim)
                continue
            try:
                start, length = (int(v) for v in piece.split(","))
            except ValueError:
                raise ValueError(f"bad slice {piece!r} in shape_and_slice {text!r}") from None
            offsets.append(start)
            lengths.append(length)
        return cls(shape, Box(tuple(offsets), tuple(lengths)))

    def __str__(self) -> str:
        if not self.shape:
            return ""
        parts = []
        for dim, o, n in zip(self.shape, self.box.offsets, self.box.lengths, strict=True):
            parts.append("-" if (o == 0 and n == dim) else f"{o},{n}")
        return " ".join(str(d) for d in self.shape) + " " + ":".join(parts)


#: Elements of ranges up to which :func:`grid_points` hands them to ``itertools.product``.
_EAGER = 1 << 16


def grid_points(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    """Every point of the grid ``ranges`` span, in C order (as ``itertools.product``),
    holding one point at a time. ``itertools.product`` first makes a tuple of each range:
    a grid with an empty range beside one of ``2**40`` (no point at all) would take
    terabytes, and a consumer that stops at its first point would pay for the whole
    range. Here the cost follows the points asked for::

        >>> list(grid_points([range(2), range(1, 3)]))
        [(0, 1), (0, 2), (1, 1), (1, 2)]
        >>> list(grid_points([range(0), range(2**40)]))
        []
    """
    if not all(ranges):
        return iter(())
    if sum(r.stop - r.start for r in ranges) <= _EAGER:
        return itertools.product(*ranges)  # (faster, and as small)
    return _odometer(ranges)


def _odometer(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    *outer, last = ranges
    for prefix in _odometer(outer) if outer else iter([()]):
        for i in last:
            yield (*prefix, i)


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of piece ``index`` when ``torch.chunk`` splits ``length`` into ``parts``.

    torch.chunk (and DTensor's Shard) uses pieces of ``ceil(length / parts)``; trailing pieces
    may be shorter or empty.
    """
    size = -(-length // parts) if parts else 0
    start = min(size * index, length)
    return start, max(0, min(size, length - start))


def c_order_bands(shape: Sequence[int], itemsize: int, limit: int) -> Iterator[Box]:
    """Boxes covering an array of ``shape`` in C order, each one contiguous run of at most
    ``limit`` bytes (or one element, if larger)."""
    shape = tuple(shape)
    if not shape:
        yield Box((), ())
        return
    d = 0
    while d < len(shape) - 1 and math.prod(shape[d + 1 :]) * itemsize > limit:
        d += 1
    row = math.prod(shape[d + 1 :]) * itemsize
    step = max(1, limit // max(row, 1))
    for lead in grid_points([range(n) for n in shape[:d]]):
        for start in range(0, shape[d], step):
            yield Box(
                (*lead, start, *([0] * (len(shape) - d - 1))),
                ((1,) * d + (min(step, shape[d] - start),) + shape[d + 1 :]),
            )


def byte_runs(shape: Sequence[int], box: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` in bytes of the contiguous runs that ``box`` occupies in a
    C-order array of ``shape``, in C order: concatenated, they are the box's own C-order
    bytes. Trailing dimensions the box spans whole merge into one run::

        >>> list(byte_runs((4, 6), Box((1, 2), (2, 3)), 1))
        [(8, 3), (14, 3)]
        >>> list(byte_runs((4, 6), Box((1, 0), (2, 6)), 1))
        [(6, 12)]
    """
    shape = tuple(int(n) for n in shape)
    if box.empty:
        return
    k = len(shape) - 1  # the innermost dimension the box does not span whole
    while k >= 0 and box.offsets[k] == 0 and box.lengths[k] == shape[k]:
        k -= 1
    if k < 0:
        yield 0, math.prod(shape) * itemsize
        return
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    length = box.lengths[k] * strides[k]
    base = box.offsets[k] * strides[k]
    for lead in grid_points([range(o, o + n) for o, n in zip(box.offsets[:k], box.lengths[:k])]):
        yield base + sum(i * s for i, s in zip(lead, strides, strict=False)), length

"""Validation of every rank's description before a save (coordinator only; pure).

Per variable, across the ranks holding it: one kind, dtype and global shape; values and
replicated tensors (by checksum) identical; and the boxes of a tensor either tile it as a
regular grid (``torch.chunk``-style, replicas allowed) or are identical or disjoint boxes
that cover it with no gap. Every inconsistency found is reported in one
:class:`~distckpt.errors.ValidationError` naming the variable and the ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.errors import ValidationError
from distckpt.planning.describe import Desc, RankDesc, Schema, rank_desc
from distckpt.slices import Box
from distckpt.tiling import tiling_problem
from distckpt.values import show

_NONE = np.zeros(0, dtype=np.int64)


def raise_inconsistent(errors: list[str]) -> None:
    """Raise :class:`ValidationError` listing ``errors`` (the first ten), if any."""
    if errors:
        shown = errors[:10]
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ValidationError(
            "cannot save: the ranks' states are inconsistent:\n  " + "\n  ".join(shown) + more
        )


@dataclass
class Holders:
    """Every rank holding one variable, as arrays: ranks ``(n,)``, offsets and lengths
    ``(n, ndim)`` of their boxes (tensors), in rank order."""

    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    ranks: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    replicated: np.ndarray  # bool per holder
    forms: list[tuple[str | None, tuple[int, ...] | None]]  # per holder of a per-rank
    # variable: its dtype and shape (None, None: a per-rank value)

    @property
    def nbytes(self) -> int:
        if self.dtype is None or self.shape is None:
            return 0
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def survey(ranks: Sequence[RankDesc]) -> tuple[dict[str, Holders], list[str]]:
    """Every variable's :class:`Holders` (by name, in order of first appearance) and the
    inconsistencies found between ranks. Every ``schema`` must be set."""
    groups: dict[bytes, tuple[Schema, list[int]]] = {}
    for r, desc in enumerate(ranks):
        assert desc.schema is not None, "survey needs every rank's schema"
        groups.setdefault(desc.digest, (desc.schema, []))[1].append(r)
    # name -> [(schema, leaf index, ranks, box matrix)]
    parts: dict[str, list[tuple[Schema, int, np.ndarray, np.ndarray | None]]] = defaultdict(list)
    for schema, members in groups.values():
        rank_ids = np.asarray(members, dtype=np.int64)
        # (ranks, slots), stored a slot at a time: a variable's columns are contiguous.
        matrix = (
            np.stack([ranks[r].boxes for r in members], axis=1).T
            if schema.width
            else np.zeros((len(members), 0), dtype=np.int64)
        )
        for i, (name, *_rest) in enumerate(schema.entries):
            parts[name].append((schema, i, rank_ids, matrix))
    holders: dict[str, Holders] = {}
    errors: list[str] = []
    for name, found in parts.items():
        found.sort(key=lambda p: int(p[2][0]))  # the group of the lowest rank first
        error = _consistent(name, found)
        if error is not None:
            errors.append(error)
            continue
        schema, i, _, _ = found[0]
        _, kind, dtype, shape, _ = schema.entries[i]
        rank_parts: list[np.ndarray] = []
        offs: list[np.ndarray] = []
        lens: list[np.ndarray] = []
        reps: list[np.ndarray] = []
        forms: list[tuple[str | None, tuple[int, ...] | None]] = []
        for sch, j, group_ranks, box_matrix in found:
            rank_parts.append(group_ranks)
            slot = sch.slots[j]
            entry_shape = sch.entries[j][3]
            if slot is not None and box_matrix is not None and entry_shape is not None:
                d = len(entry_shape)
                offs.append(box_matrix[:, slot : slot + d])
                lens.append(box_matrix[:, slot + d : slot + 2 * d])
            reps.append(np.full(len(group_ranks), sch.entries[j][4]))
            if kind == "per_rank":  # each rank's own dtype and shape (None: a value)
                forms.extend([(sch.entries[j][2], entry_shape)] * len(group_ranks))
        ndim = len(shape) if shape is not None else 0
        all_ranks = np.concatenate(rank_parts) if len(rank_parts) > 1 else rank_parts[0]
        empty = np.zeros((len(all_ranks), ndim), dtype=np.int64)
        h = Holders(
            name,
            kind,
            dtype,
            shape,
            all_ranks,
            np.concatenate(offs) if len(offs) > 1 else (offs[0] if offs else empty),
            np.concatenate(lens) if len(lens) > 1 else (lens[0] if lens else empty),
            np.concatenate(reps) if len(reps) > 1 else reps[0],
            forms,
        )
        if len(rank_parts) > 1:  # in rank order
            order = np.argsort(all_ranks, kind="stable")
            h.ranks, h.offsets = all_ranks[order], h.offsets[order]
            h.lengths = h.lengths[order]
            h.replicated = h.replicated[order]
            h.forms = [forms[k] for k in order.tolist()] if forms else []
        holders[name] = h
    return holders, errors


def _consistent(
    name: str, found: list[tuple[Schema, int, np.ndarray, np.ndarray | None]]
) -> str | None:
    """The first inconsistency of kind, dtype or shape between the groups holding
    ``name`` (reported as the lowest rank of each side), or None."""
    schema0, i0, ranks0, _ = found[0]
    _, kind0, dtype0, shape0, _ = schema0.entries[i0]
    r0 = int(ranks0[0])
    differing: list[tuple[int, str]] = []
    for schema, i, members, _ in found[1:]:
        _, kind, dtype, shape, _ = schema.entries[i]
        r = int(members[0])
        if kind != kind0:
            differing.append((r, f"{name!r} is a {kind0} on rank {r0} but a {kind} on rank {r}"))
        elif kind0 == "per_rank" or kind0 == "value":
            continue
        elif dtype != dtype0:
            differing.append((r, f"{name!r}: dtype {dtype0} on rank {r0} but {dtype} on rank {r}"))
        elif shape != shape0:
            differing.append(
                (
                    r,
                    f"{name!r}: global shape {list(shape0 or ())} on rank {r0} but "
                    f"{list(shape or ())} on rank {r}",
                )
            )
    return min(differing)[1] if differing else None


def check_contents(kinds: dict[str, str], ranks: Sequence[RankDesc]) -> list[str]:
    """The values that differ between the ranks holding them, and the replicated tensors
    whose checksums differ (of those checked on more than one rank)."""
    values = (
        (r, name, value)
        for r, desc in enumerate(ranks)
        for name, value in desc.values.items()
        if kinds.get(name) == "value"
    )
    crcs = ((r, name, crc) for r, desc in enumerate(ranks) for name, crc in desc.checksums.items())
    return [
        *(_value_differs(name, r0, v0, r, v) for name, r0, v0, r, v in _differences(values)),
        *(
            f"{name!r}: a plain tensor is saved as replicated but differs between rank {r0} "
            f"and rank {r}; use distckpt.Shard or a DTensor for partitioned values and "
            "distckpt.PerRank for per-rank state"
            for name, r0, _, r, _ in _differences(crcs)
        ),
    ]


def _value_differs(name: str, r0: int, v0: Any, r: int, v: Any) -> str:
    """The message for a value (encoded, see :mod:`distckpt.values`) that differs between
    ranks ``r0`` and ``r``: the two values as the user holds them, cut short, and where
    inside them they first differ."""
    where, a, b = _first_difference(v0, v)
    inside = f", first at {where}: {show(a)} on rank {r0}, {show(b)} on rank {r}" if where else ""
    return (
        f"{name!r}: the value differs between rank {r0} ({show(v0)}) and rank {r} "
        f"({show(v)}){inside}; wrap state that differs by rank in distckpt.PerRank "
        "(a state_dict() may return it too)"
    )


def _first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any]:
    """Where the encoded values ``a`` and ``b`` first differ, as the index into the
    decoded value (``['epoch'][0]``; empty: the values themselves), and what each holds
    there. Walks the containers that both hold alike (same kind and keys)."""
    pairs: list[tuple[str, Any, Any]] = []
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = [(f"[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    elif (
        isinstance(a, dict)
        and isinstance(b, dict)
        and len(a) == len(b) == 1
        and a.keys() == b.keys()
    ):
        ((tag, x),), y = a.items(), b[next(iter(a))]
        if tag == "tuple" and isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            pairs = [(f"[{i}]", p, q) for i, (p, q) in enumerate(zip(x, y))]
        elif tag == "map" and isinstance(x, dict) and isinstance(y, dict) and list(x) == list(y):
            pairs = [(f"[{k!r}]", x[k], y[k]) for k in x]
        elif (
            tag == "dict"
            and isinstance(x, list)
            and isinstance(y, list)
            and len(x) == len(y)
            and all(isinstance(p, list) and len(p) == 2 for p in (*x, *y))
            and [p[0] for p in x] == [q[0] for q in y]
        ):
            pairs = [(f"[{show(p[0])}]", p[1], q[1]) for p, q in zip(x, y)]
    for key, x, y in pairs:
        if x != y:
            return _first_difference(x, y, where + key)
    return where, a, b


def _differences(
    held: Iterable[tuple[int, str, Any]],
) -> Iterator[tuple[str, int, Any, int, Any]]:
    """For each name, the first rank whose item differs from the first rank's: (name,
    first rank, its item, that rank, its item)."""
    firsts: dict[str, tuple[int, Any]] = {}
    reported: set[str] = set()
    for r, name, item in held:
        r0, first = firsts.setdefault(name, (r, item))
        if first != item and name not in reported:
            reported.add(name)
            yield name, r0, first, r, item


def checked(ranks: Sequence[RankDesc]) -> list[tuple[Holders, Partition | None]]:
    """Every variable's holders and, for a tensor, its partition, once every rank's
    description is consistent; else :class:`ValidationError` naming every inconsistency."""
    holders, errors = survey(ranks)
    errors += check_contents({n: h.kind for n, h in holders.items()}, ranks)
    out: list[tuple[Holders, Partition | None]] = []
    for h in holders.values():
        part = Partition.of(h) if h.kind == "tensor" else None
        if part is not None and part.error is not None:
            errors.append(part.error)
        out.append((h, part))
    raise_inconsistent(errors)
    return out


@dataclass
class Partition:
    """A tensor's distinct non-empty boxes (``offsets``, ``lengths``: ``(m, ndim)``), which
    holder holds which (``box_of``: per holder, -1 for an empty box), and its layout."""

    offsets: np.ndarray
    lengths: np.ndarray
    box_of: np.ndarray
    grid: tuple[int, ...] | None
    error: str | None = None

    @classmethod
    def of(cls, h: Holders) -> Partition:
        assert h.shape is not None
        shape = h.shape
        ndim = len(shape)
        nonempty = np.all(h.lengths > 0, axis=1) if ndim else np.ones(len(h.ranks), dtype=bool)
        keys = np.concatenate([h.offsets, h.lengths], axis=1)[nonempty]
        distinct, inverse = _distinct_rows(keys)
        box_of = np.full(len(h.ranks), -1, dtype=np.int64)
        box_of[nonempty] = inverse
        offsets, lengths = distinct[:, :ndim], distinct[:, ndim:]
        part = cls(offsets, lengths, box_of, _regular_grid(shape, offsets, lengths))
        if part.grid is None and h.nbytes:  # (no box at all: nothing covered)
            part.error = part._irregular_error(h)
        return part

    def boxes(self) -> list[Box]:
        return [
            Box(tuple(o), tuple(n))
            for o, n in zip(self.offsets.tolist(), self.lengths.tolist(), strict=True)
        ]

    def _irregular_error(self, h: Holders) -> str | None:
        """For a partition that is not a regular grid: partial overlaps, or a gap."""
        assert h.shape is not None
        boxes = self.boxes()
        first_holder: dict[Box, int] = {}
        for k, b in enumerate(self.box_of.tolist()):
            if b >= 0:
                first_holder.setdefault(boxes[b], int(h.ranks[k]))
        problem = tiling_problem(boxes, Box.full(h.shape))
        if problem is None:
            return None
        if problem.kind == "overlap":  # (of distinct boxes: replicas are one box here)
            a, b = problem.boxes
            return (
                f"{h.name!r}: slices {a} (rank {first_holder[a]}) and {b} (rank "
                f"{first_holder[b]}) overlap partially; ranks must hold identical or disjoint boxes"
            )
        if problem.kind == "outside":
            box = problem.boxes[0]
            return (
                f"{h.name!r}: slice {box} (rank {first_holder[box]}) lies outside the global "
                f"shape {list(h.shape)}"
            )
        total = math.prod(h.shape)
        if problem.kind == "gap":  # (disjoint boxes: their count is what they cover)
            covered = sum(b.numel for b in boxes)
            return (
                f"{h.name!r}: the ranks' slices cover {covered} of the {total} elements of global "
                f"shape {list(h.shape)}, not {problem.boxes[0]}; slices held: "
                + ", ".join(str(b) for b in boxes[:8])
            )
        return f"{h.name!r}: the ranks' slices: {problem}"


def _distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a non-negative integer matrix, in lexicographic order, and each
    row's index among them. Rows whose columns fit 62 bits together are packed into one
    integer each and sorted as such; others are sorted column by column."""
    if len(rows) == 0:
        return rows, _NONE
    if rows.shape[1] == 0:
        return rows[:1], np.zeros(len(rows), dtype=np.int64)
    bits = [int(top).bit_length() for top in rows.max(axis=0).tolist()]
    if sum(bits) <= 62:
        key = rows[:, 0].copy()
        for j in range(1, rows.shape[1]):
            key <<= bits[j]
            key |= rows[:, j]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return rows[first], inverse.reshape(-1)
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    inverse = np.empty(len(rows), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _regular_grid(
    shape: tuple[int, ...], offsets: np.ndarray, lengths: np.ndarray
) -> tuple[int, ...] | None:
    """The shard shape if the distinct boxes tile ``shape`` as a regular grid (per
    dimension equal pieces, the last possibly shorter, as ``torch.chunk`` and DTensor
    split), else None. See :func:`distckpt.planning.layout.regular_grid`."""
    m = len(offsets)
    if m == 0:
        return None
    chunk: list[int] = []
    count = 1
    for d, n in enumerate(shape):
        starts, sizes = offsets[:, d], lengths[:, d]
        if starts.max() == 0 and sizes.min() == n:  # not split along this dimension
            chunk.append(n)
            continue
        pairs, _ = _distinct_rows(np.stack([starts, sizes], axis=1))
        starts, sizes = pairs[:, 0], pairs[:, 1]
        size = int(sizes[0])
        ends = starts + sizes
        if (
            starts[0] != 0
            or np.any(starts[1:] != ends[:-1])
            or np.any(sizes[:-1] != size)
            or sizes[-1] > size
            or ends[-1] != n
        ):
            return None
        chunk.append(size)
        count *= len(pairs)
    return tuple(chunk) if count == m else None


def validate(descs_by_rank: Sequence[Sequence[Desc]]) -> dict[str, list[tuple[int, Desc]]]:
    """Every variable's descriptions by rank, in order of first appearance, once they are
    consistent; else :class:`ValidationError` naming every inconsistent variable."""
    checked([rank_desc(d) for d in descs_by_rank])
    by_name: dict[str, list[tuple[int, Desc]]] = defaultdict(list)
    for rank, descs in enumerate(descs_by_rank):
        for d in descs:
            by_name[d.name].append((rank, d))
    return by_name


def owners(held: list[tuple[int, Desc]]) -> dict[Box, list[int]]:
    """Distinct boxes and the ranks holding each (replicas share a box)."""
    found: dict[Box, list[int]] = defaultdict(list)
    for r, d in held:
        assert d.box is not None
        found[d.box].append(r)
    return found

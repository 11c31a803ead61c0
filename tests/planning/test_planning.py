"""Pure planning: validation, layouts, writer choice, and resharding through the read plan,
all from hand-built per-rank descriptions, without storage or communication."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from distckpt.errors import ValidationError
from distckpt.planning.describe import Desc
from distckpt.planning.layout import inner_chunks, regular_grid
from distckpt.planning.read_plan import plan_reads
from distckpt.planning.save_plan import make_save_plan
from distckpt.slices import Box, chunk_bounds
from distckpt.values import encode


def row_shards(name, shape, world, dtype="float32"):
    """Per-rank descriptions of a tensor split on dim 0 as torch.chunk does."""
    out = []
    for r in range(world):
        start, size = chunk_bounds(shape[0], world, r)
        box = Box((start, *([0] * (len(shape) - 1))), (size, *shape[1:]))
        out.append([Desc(name, "tensor", dtype=dtype, shape=shape, box=box)])
    return out


def rep(n, checksum):
    """A replicated 1-d float32 tensor 'w' of length n with the given checksum."""
    return Desc(
        "w",
        "tensor",
        dtype="float32",
        shape=(n,),
        box=Box.full((n,)),
        replicated=True,
        checksum=checksum,
    )


def merge(*per_rank_lists):
    return [sum(parts, []) for parts in zip(*per_rank_lists, strict=True)]


def test_regular_grid_detection():
    assert regular_grid((10,), [Box((0,), (4,)), Box((4,), (4,)), Box((8,), (2,))]) == (4,)
    assert regular_grid((10,), [Box((0,), (3,)), Box((3,), (7,))]) is None  # irregular
    assert regular_grid((10,), [Box((0,), (4,)), Box((4,), (4,))]) is None  # gap
    assert regular_grid((10,), [Box((0,), (6,)), Box((4,), (6,))]) is None  # overlap
    quads = [Box((i, j), (2, 3)) for i in (0, 2) for j in (0, 3)]
    assert regular_grid((4, 6), quads) == (2, 3)
    assert regular_grid((4, 6), quads[:3]) is None


def test_inner_chunks_divide_the_block_and_respect_the_budget():
    for block, itemsize, budget in [((4096, 4096), 4, 4 << 20), ((12, 7), 8, 100), ((5,), 1, 2)]:
        inner = inner_chunks(block, itemsize, budget)
        assert all(b % i == 0 for b, i in zip(block, inner, strict=True))
        n = np.prod(inner) * itemsize
        assert n <= budget or all(i == 1 for i in inner[:-1])


def test_regular_partition_is_one_array_one_writer_per_box():
    plan = make_save_plan(row_shards("w", (1000, 1000), 4))
    (var,) = plan.specs
    pieces = plan.pieces_of(var)
    assert var.layout == "regular"
    assert [p.writer for p in sorted(pieces, key=lambda p: p.box)] == [0, 1, 2, 3]
    assert len({p.file for p in pieces}) == 4
    assert sum(p.meta is not None for p in pieces) == 1  # one zarr.json writer


def test_replicas_are_written_once_and_spread_by_bytes():
    world = 4
    descs = [
        [
            Desc(
                f"t{i}",
                "tensor",
                dtype="float32",
                shape=(256, 1024),
                box=Box.full((256, 1024)),
                replicated=True,
                checksum=7,
            )
            for i in range(8)
        ]
        for _ in range(world)
    ]
    plan = make_save_plan(descs)
    writers = Counter(p.writer for v in plan.specs for p in plan.pieces_of(v))
    assert sum(writers.values()) == 8
    assert set(writers.values()) == {2}  # 8 equal tensors over 4 ranks: 2 each


def test_small_sharded_tensors_are_gathered_to_one_writer():
    world = 16
    descs = merge(*(row_shards(f"s{i}", (48, 64), world) for i in range(1000)))
    plan = make_save_plan(descs)
    pieces = [plan.pieces_of(v) for v in plan.specs]
    assert all(v.layout == "small" and v.count == 1 for v in plan.specs)
    files = {p.file for ps in pieces for p in ps}
    assert len(files) == 1000  # not 16,000
    # every holder of a box is a source
    assert all(len(ps[0].sources) == world for ps in pieces)
    # 12 MB of small tensors: three evenly spaced writers (three gathers), balanced by bytes
    writers = Counter(ps[0].writer for ps in pieces)
    assert sorted(writers) == [0, 5, 10]
    assert max(writers.values()) - min(writers.values()) <= 1
    works = plan.work()
    assert all(w.exchange_writers == [0, 5, 10] for w in works)
    assert sum(len(w.writes) for w in works) == 1000
    assert len(works[3].sends) == 1000 and len(works[0].sends) == 1000 - writers[0]


def test_irregular_partition_uses_one_array_per_box():
    descs = [
        [Desc("x", "tensor", dtype="int8", shape=(10, 2), box=Box((0, 0), (3, 2)))],
        [Desc("x", "tensor", dtype="int8", shape=(10, 2), box=Box((3, 0), (7, 2)))],
    ]
    plan = make_save_plan(descs, small_bytes=0)
    (var,) = plan.specs
    assert var.layout == "boxes"
    assert sorted(p.file for p in plan.pieces_of(var)) == ["x/p0/c.0.0", "x/p1/c.0.0"]
    assert "x" in plan.groups


@pytest.mark.parametrize(
    ("descs", "match"),
    [
        (
            [
                [rep(4, 1)],
                [rep(5, 1)],
            ],
            r"'w': global shape \[4\] on rank 0 but \[5\] on rank 1",
        ),
        (
            [
                [Desc("w", "tensor", dtype="float32", shape=(4,), box=Box((0,), (2,)))],
                [Desc("w", "tensor", dtype="bfloat16", shape=(4,), box=Box((2,), (2,)))],
            ],
            "'w': dtype float32 on rank 0 but bfloat16 on rank 1",
        ),
        (
            [
                [Desc("w", "tensor", dtype="float32", shape=(4,), box=Box((0,), (3,)))],
                [Desc("w", "tensor", dtype="float32", shape=(4,), box=Box((2,), (2,)))],
            ],
            r"'w': slices \[0:3\] \(rank 0\) and \[2:4\] \(rank 1\) overlap partially",
        ),
        (
            [
                [Desc("w", "tensor", dtype="float32", shape=(6,), box=Box((0,), (2,)))],
                [Desc("w", "tensor", dtype="float32", shape=(6,), box=Box((3,), (3,)))],
            ],
            r"cover 5 of the 6 elements",
        ),
        (
            [
                [rep(4, 1)],
                [rep(4, 1)],
                [rep(4, 2)],
            ],
            "differs between rank 0 and rank 2",
        ),
        (
            [[Desc("lr", "value", value=0.1)], [Desc("lr", "value", value=0.2)]],
            r"'lr': the value differs between rank 0 \(0.1\) and rank 1 \(0.2\)",
        ),
        (
            [
                [Desc("lr", "value", value=0.1)],
                [Desc("lr", "tensor", dtype="float32", shape=(), box=Box((), ()))],
            ],
            "'lr' is a value on rank 0 but a tensor on rank 1",
        ),
    ],
)
def test_validation_errors_name_the_variable_and_ranks(descs, match):
    with pytest.raises(ValidationError, match=match):
        make_save_plan(descs)


def test_a_differing_value_is_shown_as_the_user_holds_it():
    """A value that differs by rank (an Accelerate custom object's state, say) is named
    with the values as saved, not their stored encoding, cut short, and with the place
    inside them where they first differ."""
    states = [
        {"0": {"seen": {0: r, 1: "x" * 300}, "epoch": (1, float("nan")), "blob": b"\x00"}}
        for r in (0, 1)
    ]
    descs = [[Desc("custom", "value", value=encode(s, allow_pickle=True))] for s in states]
    with pytest.raises(ValidationError) as caught:
        make_save_plan(descs)
    message = str(caught.value)
    assert "{'map'" not in message and "{'dict'" not in message and "tuple" not in message
    assert "'custom': the value differs between rank 0 ({'0': {'seen': {0: 0, 1: 'xxx" in message
    assert "first at ['0']['seen'][0]: 0 on rank 0, 1 on rank 1" in message
    assert "x" * 100 not in message  # the 300 characters are cut
    assert "distckpt.PerRank (a state_dict() may return it too)" in message
    # A pickled object is shown, never unpickled; NaN equals NaN where it is stored.
    pickled = [
        [Desc("cfg", "value", value=encode((float("nan"), {1}, r), allow_pickle=True))]
        for r in (0, 1)
    ]
    with pytest.raises(ValidationError, match=r"\(nan, <pickled object>, 0\).*first at \[2\]: 0"):
        make_save_plan(pickled)


def _reshard_in_memory(shape, save_world, load_world, split_dim):
    """Feed the save plan's pieces straight into read plans for another world size."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal(shape).astype(np.float32)

    def boxes(world):
        out = []
        for r in range(world):
            start, size = chunk_bounds(shape[split_dim], world, r)
            offsets = [0] * len(shape)
            lengths = list(shape)
            offsets[split_dim], lengths[split_dim] = start, size
            out.append(Box(tuple(offsets), tuple(lengths)))
        return out

    descs = [[Desc("w", "tensor", dtype="float32", shape=shape, box=b)] for b in boxes(save_world)]
    plan = make_save_plan(descs, small_bytes=0, inner_bytes=64)
    pieces = plan.pieces_of(plan.specs[0])
    stored = {p.file: full[p.box.slices()] for p in pieces}
    for target in boxes(load_world):
        out = np.full(target.lengths, np.nan, dtype=np.float32)
        copies = list(plan_reads(target, pieces))
        assert sum(c.dst.numel for c in copies) == target.numel
        for c in copies:
            out[c.dst.slices()] = stored[c.piece.file][c.src.slices()]
        np.testing.assert_array_equal(out, full[target.slices()])


@pytest.mark.parametrize(
    ("save_world", "load_world"), list(itertools.product([1, 2, 3, 4, 7], repeat=2))
)
def test_reshard_any_world_size_to_any_other(save_world, load_world):
    _reshard_in_memory((13, 5), save_world, load_world, split_dim=0)
    _reshard_in_memory((3, 11), save_world, load_world, split_dim=1)


def test_per_rank_tensors_keep_each_rank_s_dtype_and_values_mix_with_tensors():
    descs = [
        [Desc("x", "per_rank", dtype="float32", shape=(3,), box=Box.full((3,)))],
        [Desc("x", "per_rank", dtype="int64", shape=(5,), box=Box.full((5,)))],
        [Desc("x", "per_rank", value={"int": 7})],
    ]
    plan = make_save_plan(descs)
    (var,) = plan.specs
    pieces = plan.pieces_of(var)
    assert [(p.rank, p.dtype, p.box.lengths) for p in pieces] == [
        (0, "float32", (3,)),
        (1, "int64", (5,)),
    ]
    assert [p.meta["data_type"] for p in pieces if p.meta] == ["float32", "int64"]
    assert [w.writes[0].dtype for w in plan.work()[:2]] == ["float32", "int64"]


def test_a_tensor_no_rank_holds_a_box_of_is_refused():
    empty = Box((0,), (0,))
    descs = [[Desc("t", "tensor", dtype="float32", shape=(4,), box=empty)] for _ in range(2)]
    with pytest.raises(ValidationError, match="'t': the ranks' slices cover 0 of the 4"):
        make_save_plan(descs)


def test_a_rank_without_leaves_takes_part_in_a_fresh_plan():
    from distckpt.engine import agree
    from distckpt.planning.describe import rank_desc

    ranks = [rank_desc([Desc("a", "tensor", dtype="float32", shape=(4,), box=Box.full((4,)))])]
    ranks.append(rank_desc([]))
    offers = [
        agree.Offer(None, agree.fingerprint(d, r), d.digest, {}, {}) for r, d in enumerate(ranks)
    ]
    fulls = [agree.Full(d.schema, d.boxes, {}) for d in ranks]
    try:
        fresh = agree.plan_fresh(offers, fulls, ranks[0].schema, agree.Terms(2))
    finally:
        agree.forget_plans()
    assert [s.writes.tolist() for s in fresh.shares] == [[0], []]


def _column_bands(world: int, moved: int | None = None) -> list[list[Desc]]:
    """Per-rank descriptions of a [4, N] tensor split along dim 1 in bands of uneven
    widths (every box spans all of dim 0); ``moved``: that rank's band one column right."""
    widths = [1 + r % 3 for r in range(world)]
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
    shape = (4, sum(widths))
    return [
        [Desc("w", "tensor", dtype="float32", shape=shape, box=Box((0, s + (r == moved)), (4, w)))]
        for r, (s, w) in enumerate(zip(starts, widths, strict=True))
    ]


def test_validation_of_thousands_of_irregular_slices_is_fast():
    from time import perf_counter

    from distckpt.planning.validate import validate

    t0 = perf_counter()
    validate(_column_bands(8192))
    assert perf_counter() - t0 < 5
    with pytest.raises(ValidationError, match=r"\(rank 100\) .*overlap partially"):
        validate(_column_bands(8192, moved=100))

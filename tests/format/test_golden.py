"""Format stability: checkpoints committed under tests/golden/ must keep loading.

tests/support/make_golden.py wrote them (2 MPI ranks, and one process for the dtype table) and
holds the functions that recompute the expected values; a change of the library that
can no longer read format version 1 fails here. The multi-rank restore of the same
checkpoint onto another world size runs in tests/engine/test_failures.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distckpt
from distckpt.comm import SingleComm
from tests.support.make_golden import (
    DTYPE_NAMES,
    DTYPES,
    FLAT_ROWS,
    TWO_RANKS,
    assert_same_bits,
    assert_same_value,
    dtype_tensor,
    emb,
    flat,
    loader,
    rng,
    scalar,
    slashed,
    small,
    target,
    tensor_bytes,
    values,
    weight,
)

pytestmark = pytest.mark.timeout(60)

# Recorded when the golden files were written; a change here is a format change.
TWO_RANKS_VARIABLES = [
    ("__scalar", (), "float32"),
    ("bias", (3,), "float64"),
    ("cfg", None, "value"),
    ("loader", None, "per_rank"),
    ("model/emb", (6, 8), "bfloat16"),
    ("model/l1.weight", (5, 8), "float32"),
    ("odd/a%2Fb", (3,), "int16"),
    ("opt/flat", (6, 4), "int32"),
    ("rng", None, "per_rank"),
    ("step", None, "value"),
]
DTYPES_VARIABLES = [(name, (8,), name) for name in sorted(DTYPE_NAMES)]


def test_golden_files_are_small_and_complete() -> None:
    files = [p for root in (TWO_RANKS, DTYPES) for p in root.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 50 * 1024
    index = json.loads((TWO_RANKS / "zarr.json").read_bytes())["attributes"]["distckpt"]
    assert index["format"] == "distckpt" and index["format_version"] == 1
    assert index["world_size"] == 2
    layouts = {k: v.get("layout") for k, v in index["variables"].items()}
    assert layouts["model/l1.weight"] == "regular" and layouts["model/emb"] == "regular"
    assert layouts["opt/flat"] == "boxes" and layouts["bias"] == "small"
    # the edge shard of l1.weight is shorter than the others: an absent inner chunk
    pieces = index["variables"]["model/l1.weight"]["pieces"]
    assert sorted(p["box"][1][0] for p in pieces) == [2, 3]


def test_list_variables_matches_the_record() -> None:
    assert [tuple(v) for v in distckpt.list_variables(TWO_RANKS)] == TWO_RANKS_VARIABLES
    assert [tuple(v) for v in distckpt.list_variables(DTYPES)] == DTYPES_VARIABLES


def _full_target() -> dict[str, Any]:
    return target(
        torch.zeros(5, 8),
        torch.zeros(6, 8, dtype=torch.bfloat16),
        torch.zeros(6, 4, dtype=torch.int32),
    )


def test_two_rank_golden_loads_in_one_process() -> None:
    state = _full_target()
    result = distckpt.load(state, TWO_RANKS, SingleComm())
    assert sorted(result.loaded) == sorted(v[0] for v in TWO_RANKS_VARIABLES)
    assert_same_bits(state["model"]["l1.weight"], weight(), "l1.weight")
    assert_same_bits(state["model"]["emb"], emb(), "emb")
    assert_same_bits(state["opt"]["flat"], flat(), "flat")
    assert_same_bits(state["bias"], small(), "bias")
    assert_same_bits(state["__scalar"], scalar(), "__scalar")
    assert_same_bits(state["odd"]["a/b"], slashed(), "a/b")
    # saved on 2 ranks, restored on 1: rank 0 takes what rank 0 saved
    assert_same_bits(state["rng"].value, rng(0), "rng")
    assert_same_value(state["loader"].value, loader(0), "loader")
    want = values()
    assert_same_value(state["step"], want["step"], "step")
    assert_same_value(state["cfg"], want["cfg"], "cfg")


@pytest.mark.parametrize("rank", [0, 1])
def test_per_rank_entries(rank: int) -> None:
    """Each saved rank's PerRank entry, read as rank ``rank`` of a 2-process job would."""

    class AsRank(SingleComm):
        def __init__(self) -> None:
            super().__init__()
            self.rank, self.size = rank, 2

        def allgather(self, obj: Any) -> list[Any]:
            return [obj, obj]  # the other rank restores the same names, and succeeds

        def broadcast(self, obj: Any, root: int = 0) -> Any:
            # A load's one broadcast: rank 0 sends the index it read.
            return obj if rank == root else (TWO_RANKS / "zarr.json").read_bytes()

    state: dict[str, Any] = {"rng": distckpt.PerRank(None), "loader": distckpt.PerRank(None)}
    distckpt.load(state, TWO_RANKS, AsRank(), strict=False)
    assert_same_bits(state["rng"].value, rng(rank))
    assert_same_value(state["loader"].value, loader(rank))


@pytest.mark.parametrize(
    "name, full, start, length, dim",
    [
        ("model/l1.weight", weight, 1, 3, 0),  # across the two shards
        ("model/l1.weight", weight, 4, 1, 0),  # only the edge shard
        ("model/emb", emb, 2, 4, 1),  # across the column shards
        ("opt/flat", flat, 0, 3, 0),  # across the irregular boxes
    ],
)
def test_resharded_read_of_golden(name: str, full: Any, start: int, length: int, dim: int) -> None:
    want = full()
    part = want.narrow(dim, start, length)
    offsets = [0] * want.dim()
    offsets[dim] = start
    t = torch.full_like(part, 3)
    state: dict[str, Any] = {}
    node = state
    *parents, leaf = name.split("/")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = distckpt.Shard(t, tuple(want.shape), tuple(offsets))
    distckpt.load(state, TWO_RANKS, SingleComm(), strict=False)
    assert_same_bits(t, part.contiguous(), name)


def test_dtype_golden_loads_bit_exactly() -> None:
    state = {name: torch.zeros(8, dtype=dtype_tensor(name).dtype) for name in DTYPE_NAMES}
    distckpt.load(state, DTYPES, SingleComm())
    for name in DTYPE_NAMES:
        assert_same_bits(state[name], dtype_tensor(name), name)
    f = dtype_tensor("float32")
    assert math.isinf(f[2].item()) and math.isnan(f[3].item()) and math.copysign(1, f[1].item()) < 0


def _zarr_read(path: Path) -> np.ndarray:
    import zarr

    from distckpt.format import zarr_dtypes

    zarr_dtypes.register()
    return np.asarray(zarr.open_array(str(path), mode="r")[...])


def _ts_read(path: Path) -> np.ndarray:
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return np.asarray(ts.open(spec, read=True).result().read().result())


@pytest.mark.parametrize("reader", ["zarr", "tensorstore"])
def test_golden_reads_in_zarr_and_tensorstore(reader: str) -> None:
    read = _zarr_read if reader == "zarr" else _ts_read
    f0, f1 = FLAT_ROWS[0]
    g0, g1 = FLAT_ROWS[1]
    expected = [
        ("model/l1.weight", weight()),
        ("model/emb", emb()),
        ("opt/flat/p0", flat()[f0:f1]),
        ("opt/flat/p1", flat()[g0:g1]),
        ("bias", small()),
        ("%5F_scalar", scalar()),
        ("odd/a%2Fb", slashed()),
        ("rng/r1", rng(1)),
    ]
    for path, want in expected:
        got = read(TWO_RANKS / path)
        assert got.shape == tuple(want.shape), path
        assert got.tobytes() == tensor_bytes(want), path
    for name in DTYPE_NAMES:
        got = read(DTYPES / name)
        assert got.tobytes() == tensor_bytes(dtype_tensor(name)), name


@pytest.mark.parametrize("reader", ["zarr", "tensorstore"])
def test_every_regular_variable_opens_as_its_global_array(reader: str) -> None:
    """Every variable the golden checkpoints hold as one array (the regular layout, or one
    plain chunk for a small tensor) reads whole in both, equal to what distckpt restores."""
    from distckpt import dtypes
    from distckpt.format import index as index_mod
    from distckpt.training.names import nest

    read = _zarr_read if reader == "zarr" else _ts_read
    seen = 0
    for root in (TWO_RANKS, DTYPES):
        for name, entry in index_mod.read_index(root)["variables"].items():
            if entry.get("kind") != "tensor" or entry.get("layout") not in ("regular", "small"):
                continue
            got = read(root / entry["path"])
            assert list(got.shape) == entry["shape"], name
            out = torch.zeros(entry["shape"], dtype=dtypes.torch_dtype(entry["dtype"]))
            distckpt.load(nest({name: out}), root, SingleComm(), strict=False)
            assert got.tobytes() == tensor_bytes(out), name
            seen += 1
    assert seen >= 19, seen

"""Write the small committed checkpoints under tests/golden/ (not run by the test suite).

Usage, from the repository root, once per intentional format change::

    rm -rf tests/golden/v1-2ranks tests/golden/v1-dtypes tests/golden/v3-sealed
    mpiexec -n 2 python tests/support/make_golden.py

(``python tests/support/make_golden.py sealed`` writes ``v3-sealed`` alone, from one process.)

Writes, in format version 1:

* ``tests/golden/v1-2ranks``: saved by 2 MPI ranks: a regular partition whose last shard
  is shorter than the others (float32, padded edge shard, several inner chunks per
  shard), a bfloat16 tensor split by columns with NaN/inf/-0.0 in it, an irregular
  partition (boxes layout: one plain and one sharded piece), a small replicated float64
  tensor, a 0-d tensor under a reserved name (``__scalar``), a key with a ``/``, a
  PerRank tensor and a PerRank value, and typed Python values;
* ``tests/golden/v1-dtypes``: saved by one process: one small tensor per stored dtype,
  from fixed byte patterns (NaN payloads, subnormals, infinities included).

Both predate the metadata checksum: their indexes carry none. Written in format version
3 by a distckpt that seals its index:

* ``tests/golden/v3-sealed``: saved by one process (:func:`sealed_state`): compact
  regular entries, one plain chunk, Python values, and the index's ``checksum``.

The expected values are the functions below: tests/format/test_golden.py imports them, loads
the stored checkpoints and compares bit by bit, so a change of the library that cannot
read these files any more fails the suite.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TWO_RANKS = GOLDEN / "v1-2ranks"
DTYPES = GOLDEN / "v1-dtypes"
SEALED = GOLDEN / "v3-sealed"
WORLD = 2
SMALL_BYTES = 64  # tensors above 64 bytes are stored sharded
INNER_BYTES = 64  # and cut into inner chunks of at most 64 bytes

DTYPE_NAMES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "complex128",
]


def target(weight: Any, emb: Any, flat: Any) -> dict[str, Any]:
    """A state to restore the two-rank golden into; its three partitioned variables are the
    targets given (full tensors, or ``distckpt.Shard`` boxes of them)."""
    import distckpt

    return {
        "model": {"l1.weight": weight, "emb": emb},
        "opt": {"flat": flat},
        "bias": torch.zeros(3, dtype=torch.float64),
        "__scalar": torch.tensor(0.0),
        "odd": {"a/b": torch.zeros(3, dtype=torch.int16)},
        "rng": distckpt.PerRank(None),
        "loader": distckpt.PerRank(None),
        "step": None,
        "cfg": None,
    }


def weight() -> torch.Tensor:
    """model/l1.weight: (5, 8) float32, rows split torch.chunk-wise over 2 ranks (3 + 2)."""
    return torch.arange(40, dtype=torch.float32).reshape(5, 8) * 0.25 - 3.0


def emb() -> torch.Tensor:
    """model/emb: (6, 8) bfloat16, split by columns (4 + 4), with NaN, +-inf and -0.0."""
    t = (torch.arange(48, dtype=torch.float32).reshape(6, 8) * 0.37 - 5.0).to(torch.bfloat16)
    t[0, 0] = float("nan")
    t[0, 1] = float("inf")
    t[2, 5] = float("-inf")
    t[5, 7] = -0.0
    return t


def flat() -> torch.Tensor:
    """opt/flat: (6, 4) int32, an irregular partition: rows 0:1 on rank 0, 1:6 on rank 1."""
    return (torch.arange(24, dtype=torch.int32).reshape(6, 4) - 7) * 1000003


FLAT_ROWS = [(0, 1), (1, 6)]


def small() -> torch.Tensor:
    """bias: a small replicated float64 tensor (one plain chunk)."""
    return torch.tensor([0.1, -2.5, math.pi], dtype=torch.float64)


def scalar() -> torch.Tensor:
    """__scalar: a 0-d float32 tensor whose name needs escaping in the store."""
    return torch.tensor(1.5, dtype=torch.float32)


def slashed() -> torch.Tensor:
    """The tensor under the key ``a/b`` of ``odd``."""
    return torch.tensor([7, 8, 9], dtype=torch.int16)


def rng(rank: int) -> torch.Tensor:
    """rng: a PerRank uint8 tensor, different on each rank."""
    return torch.arange(6, dtype=torch.uint8) + 10 * rank


def loader(rank: int) -> dict[str, Any]:
    """loader: a PerRank Python value."""
    return {"rank": rank, "seed": (rank, 7), "pos": [rank * 100, None]}


def values() -> dict[str, Any]:
    """The Python values saved next to the tensors."""
    return {
        "step": 42,
        "cfg": {
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "nan": float("nan"),
            "inf": float("inf"),
            "ninf": float("-inf"),
            "ids": {1: "one", 2: "two"},
            "nested": [1, [2.0, (3, None)], {"k": True, "s": "héllo"}],
            "tuple_key": {(1, 2): "pair"},
            "flag": False,
        },
    }


def rows(rank: int, n: int, world: int) -> tuple[int, int]:
    size = -(-n // world)
    start = min(rank * size, n)
    return start, max(0, min(size, n - start))


def rank_state(rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the 2-rank job saved."""
    import distckpt

    w0, wn = rows(rank, 5, WORLD)
    c0 = 4 * rank
    f0, f1 = FLAT_ROWS[rank]
    return {
        "model": {
            "l1.weight": distckpt.Shard(weight()[w0 : w0 + wn].clone(), (5, 8), (w0, 0)),
            "emb": distckpt.Shard(emb()[:, c0 : c0 + 4].clone(), (6, 8), (0, c0)),
        },
        "opt": {"flat": distckpt.Shard(flat()[f0:f1].clone(), (6, 4), (f0, 0))},
        "bias": small(),
        "__scalar": scalar(),
        "odd": {"a/b": slashed()},
        "rng": distckpt.PerRank(rng(rank)),
        "loader": distckpt.PerRank(loader(rank)),
        **values(),
    }


def dtype_tensor(name: str) -> torch.Tensor:
    """8 elements of dtype ``name`` from a fixed byte pattern (every bit pattern is stored)."""
    import distckpt.dtypes as dt

    dtype = dt.torch_dtype(name)
    if dtype == torch.bool:
        return torch.tensor([i % 3 == 0 for i in range(8)], dtype=torch.bool)
    size = torch.empty((), dtype=dtype).element_size()
    k = DTYPE_NAMES.index(name)
    raw = [(i * 73 + 29 * k + 5) % 256 for i in range(8 * size)]
    # NaN with a payload, -0.0 and +inf patterns of the float types at fixed places
    t = torch.tensor(raw, dtype=torch.uint8).view(dtype).clone()
    if dtype.is_floating_point:
        t[1] = -0.0
        t[2] = float("inf")
        t[3] = float("nan")
    return t


def dtype_state() -> dict[str, Any]:
    return {name: dtype_tensor(name) for name in DTYPE_NAMES}


def sealed_state() -> dict[str, Any]:
    """What the one process that wrote ``v3-sealed`` saved."""
    return {
        "l1.weight": weight(),
        "emb": emb(),
        "bias": small(),
        "step": 42,
        "cfg": {"lr": 1e-3, "name": "sealed", "ids": [1, 2, 3]},
    }


def write_sealed() -> None:
    import distckpt
    from distckpt.comm import SingleComm

    distckpt.save(
        sealed_state(), SEALED, SingleComm(), small_bytes=SMALL_BYTES, inner_bytes=INNER_BYTES
    )


def main() -> None:
    import distckpt
    from distckpt.comm import SingleComm, auto

    if sys.argv[1:] == ["sealed"]:
        write_sealed()
        return
    comm = auto()
    if comm.size != WORLD:
        sys.exit(f"run me as: mpiexec -n {WORLD} python {sys.argv[0]}")
    distckpt.save(
        rank_state(comm.rank), TWO_RANKS, comm, small_bytes=SMALL_BYTES, inner_bytes=INNER_BYTES
    )
    if comm.rank == 0:
        distckpt.save(dtype_state(), DTYPES, SingleComm())
        write_sealed()
        for path in (TWO_RANKS, DTYPES, SEALED):
            total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            print(f"wrote {path} ({total} bytes)")
    comm.barrier()


if __name__ == "__main__":
    main()


# Comparison helpers shared by the tests that use these expected values.


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, for bit-exact comparison (NaN payloads, -0.0 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    assert tensor_bytes(got) == tensor_bytes(want), f"{what}: bytes differ\n{got}\n{want}"


def assert_same_value(got: Any, want: Any, where: str = "value") -> None:
    """Equal with the same types all the way down (tuple is not list, 1 is not 1.0 or True),
    NaN equal to NaN, -0.0 distinct from 0.0."""
    assert type(got) is type(want), (
        f"{where}: {type(got).__name__} {got!r} != {type(want).__name__} {want!r}"
    )
    if isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got), f"{where}: {got!r} != nan"
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (
                f"{where}: {got!r} != {want!r}"
            )
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_value(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)!r} != {list(want)!r}"
        for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True):
            assert_same_value(gk, wk, f"{where} key {wk!r}")
            assert_same_value(gv, wv, f"{where}[{wk!r}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"

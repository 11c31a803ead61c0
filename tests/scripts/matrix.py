"""Save on N ranks, restore on M ranks: every value checked bit for bit.

Usage::

    matrix.py save DIR                      # world size N: writes DIR/n{N}
    matrix.py restore DIR N1 N2 ... [DIR2 N1 N2 ...]
                                            # world size M: restores each DIR/n{N}

Runs under ``mpiexec`` (torch.distributed is started with ``init_torch_from_mpi()``, and
distckpt is given an explicit ``MPIComm``), under ``torchrun`` (distckpt's ``comm=None``,
so ``auto()`` picks the torch process group), or as one plain process (a world-size-1
gloo group over a HashStore for the DeviceMesh, and an explicit ``SingleComm``).

Every value is a pure function of the variable name (and of the rank, for PerRank
state): each rank generates the *global* tensor and slices its own box, so any rank can
compute the expected value of any box on any world size. Restores go into fresh
zero-filled targets with the same placements as saved, then (partial restores with
``strict=False``) into other placements: Shard(0) into Shard(1) and into Replicate, an
irregular ``distckpt.Shard`` partition into a DTensor and into a plain tensor, and so on.

Each rank prints ``OK <rank>`` as its last line if, and only if, every check passed;
otherwise it prints every failure (``FAIL rank ...``) and exits with status 1.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank import say
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor import Shard as DShard

import distckpt
from distckpt.comm.auto import launched_by_mpi, launched_by_torchrun
from distckpt.dtypes import SUPPORTED

INNER_BYTES = 64 * 1024  # the big tensor's shards get several inner chunks
#: Compressed variables (every restore reshards them): the others are stored raw.
COMPRESSION = {"big": "zstd", "irr/*": "blosc-lz4", "*": None}

# ---------------------------------------------------------------------------------------
# Deterministic values
# ---------------------------------------------------------------------------------------

_FLOATS_WITH_INF = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2}


def seed_of(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


def generate(key: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The global tensor for ``key``: random bit patterns (NaN payloads, subnormals and
    all), with NaN, +-inf and -0.0 in front where the dtype has them."""
    g = torch.Generator().manual_seed(seed_of(key))
    n = math.prod(shape)
    if dtype == torch.bool:
        flat = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).to(torch.bool)
    else:
        size = torch.empty((), dtype=dtype).element_size()
        flat = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype)
        flat = flat.clone()
        specials: list[Any] = []
        if dtype in _FLOATS_WITH_INF:
            specials = [float("nan"), float("inf"), float("-inf"), -0.0]
        elif dtype == torch.float8_e4m3fn:  # no inf: NaN is 0x7f, -0.0 is 0x80
            flat.view(torch.uint8)[: min(n, 2)] = torch.tensor([0x7F, 0x80], dtype=torch.uint8)[
                : min(n, 2)
            ]
        elif dtype.is_complex:
            specials = [
                complex(float("nan"), -0.0),
                complex(float("inf"), float("-inf")),
                complex(-0.0, 0.0),
            ]
        k = min(n, len(specials))
        if k:
            flat[:k] = torch.tensor(specials[:k], dtype=dtype)
    return flat.reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns: one row of bytes per element."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).reshape(-1, 1)
    return t.view(torch.uint8).reshape(t.numel(), t.element_size())


def hex_bits(row: torch.Tensor) -> str:
    return "0x" + bytes(row.tolist())[::-1].hex()  # little-endian bytes, most significant first


def bits_equal(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if equal bit for bit (dtype, shape, every element), else what differs."""
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    a, b = bits(got), bits(want)
    if torch.equal(a, b):
        return None
    bad = (a != b).any(dim=1).nonzero().reshape(-1)
    shown = []
    g, w = got.detach().reshape(-1), want.reshape(-1)
    for i in bad[:4].tolist():
        index = (
            [int(x) for x in torch.unravel_index(torch.tensor(i), want.shape)] if want.dim() else []
        )
        shown.append(
            f"at {index}: got {g[i].item()!r} (bits {hex_bits(a[i])}), "
            f"expected {w[i].item()!r} (bits {hex_bits(b[i])})"
        )
    return f"{bad.numel()} of {a.shape[0]} elements differ; " + "; ".join(shown)


def same_value(got: Any, want: Any) -> bool:
    """Equal with the same types all the way down (tuple stays tuple; NaN equals NaN)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, float):
        return (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want)
        )
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(
            same_value(x, y) for x, y in zip(got, want, strict=True)
        )
    if isinstance(want, dict):
        return list(got) == list(want) and all(
            type(k1) is type(k2) and same_value(got[k1], want[k2])
            for k1, k2 in zip(got, want, strict=True)
        )
    return bool(got == want)


# ---------------------------------------------------------------------------------------
# What is saved
# ---------------------------------------------------------------------------------------

#: 1-D mesh DTensors: name -> (global shape, dtype, placement)
DT1D: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {
    "dt/even": ((24, 8), torch.float32, DShard(0)),
    "dt/uneven": ((10, 3), torch.float32, DShard(0)),  # 4 ranks: 3,3,3,1; 3 ranks: 4,4,2
    "dt/cols": ((5, 10), torch.int32, DShard(1)),
    "dt/tiny": ((2, 5), torch.float16, DShard(0)),  # fewer rows than ranks: empty shards
    "dt/rep": ((4, 6), torch.bfloat16, Replicate()),
    # 1 MiB: the "regular" sharded layout, 64 KiB inner chunks, read across their borders
    "big": ((256, 1024), torch.float32, DShard(0)),
}
#: 2-D mesh DTensors: name -> (global shape, dtype, placements)
DT2D: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[Any, Any]]] = {
    "mesh2d/hsdp": ((12, 4), torch.float32, (Replicate(), DShard(0))),
    "mesh2d/s01": ((7, 5), torch.float64, (DShard(0), DShard(1))),
    "mesh2d/s00": ((10, 3), torch.int64, (DShard(0), DShard(0))),  # nested split of dim 0
}
PLAIN_DTYPES = list(SUPPORTED)
PLAIN: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    **{f"plain/{str(d).removeprefix('torch.')}": ((3, 5), d) for d in PLAIN_DTYPES},
    "plain/scalar": ((), torch.float64),
    "plain/empty": ((0, 3), torch.float32),
    "misc/w": ((4,), torch.int16),
    "layers/0": ((2, 2), torch.float32),
    "layers/1": ((3,), torch.bfloat16),
}
FLAT_LEN = 100_000  # 400 KB float32: above small_bytes, so irregular boxes get own arrays
IRR_COLS = 3
VALUES: dict[str, Any] = {
    "step": 7,
    "lr_nan": float("nan"),
    "neg_inf": float("-inf"),
    "neg_zero": -0.0,
    "flag": True,
    "tup": (1, (2.5, "x"), [], ()),
    "intkeys": {1: "a", 2: (3, 4), -5: None, 0: [1.5]},
    "nested": [[1, [2, [3.0]]], [], [True, None, "s"], {"k": (1,)}],
    "misc/count": 3,
}


def tri_rows(world: int) -> int:
    return world * (world + 1) // 2


def tri_range(rank: int) -> tuple[int, int]:
    """Saved irregular partition: rank r holds rows [r(r+1)/2, (r+1)(r+2)/2)."""
    return rank * (rank + 1) // 2, (rank + 1) * (rank + 2) // 2


def weighted_range(total: int, world: int, rank: int) -> tuple[int, int]:
    """Restore-side irregular partition of ``total`` (weights 1, 2, .., M; may be empty)."""
    denom = world * (world + 1) // 2
    return total * tri_rows(rank) // denom, total * tri_rows(rank + 1) // denom


def flat_range(world: int, rank: int) -> tuple[int, int]:
    """Optimizer-style flat ranges of uneven lengths: bounds L*r^2/N^2."""
    return FLAT_LEN * rank * rank // (world * world), FLAT_LEN * (rank + 1) ** 2 // (world * world)


def per_rank_tensor(rank: int) -> torch.Tensor:
    return generate(("per_rank/tensor", rank), (rank + 1, 2), torch.int64)


def per_rank_tensor2(rank: int) -> torch.Tensor:
    return generate(("per_rank/into_none", rank), (rank + 2,), torch.bfloat16)


def per_rank_value(rank: int) -> Any:
    return (rank, f"rank{rank}", [rank * 0.5, None], {rank: float("nan")})


@functools.cache
def full(name: str, n_saved: int) -> torch.Tensor:
    """The global tensor of variable ``name`` in the checkpoint saved on ``n_saved`` ranks
    (cached: never modify it)."""
    if name in DT1D:
        shape, dtype, _ = DT1D[name]
    elif name in DT2D:
        shape, dtype, _ = DT2D[name]
    elif name in PLAIN:
        shape, dtype = PLAIN[name]
    elif name == "irr/rows":
        shape, dtype = (tri_rows(n_saved), IRR_COLS), torch.float32
    elif name == "irr/flat":
        shape, dtype = (FLAT_LEN,), torch.float32
    else:
        raise KeyError(name)
    return generate(name, shape, dtype)


def all_names() -> list[str]:
    names = [*DT1D, *DT2D, *PLAIN, "irr/rows", "irr/flat", *VALUES]
    names += ["per_rank/tensor", "per_rank/into_none", "per_rank/value"]
    return sorted(names)


def mesh_2d_shape(world: int, restoring: bool) -> tuple[int, int]:
    if world == 4:
        return (2, 2)
    if world == 2:
        return (1, 2) if restoring else (2, 1)
    return (world, 1) if restoring else (1, world)


def put(state: dict[str, Any], name: str, value: Any) -> None:
    """Set ``state[a][b] = value`` for ``name == "a/b"`` (a numeric part is an int key)."""
    *parents, last = name.split("/")
    node = state
    for part in parents:
        node = node.setdefault(part, {})
    node[int(last) if last.isdigit() else last] = value


def get(state: dict[str, Any], name: str) -> Any:
    node: Any = state
    for part in name.split("/"):
        node = node[int(part) if part.isdigit() else part]
    return node


def dtensor(full_tensor: torch.Tensor, mesh: DeviceMesh, placements: Any) -> DTensor:
    """DTensor's own split of ``full_tensor`` (every rank has it: no communication)."""
    if not isinstance(placements, (list, tuple)):
        placements = [placements]
    return distribute_tensor(full_tensor, mesh, list(placements), src_data_rank=None)


def build_save_state(world: int, rank: int, mesh1: DeviceMesh, mesh2: DeviceMesh) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, (_, _, placement) in DT1D.items():
        put(state, name, dtensor(full(name, world), mesh1, placement))
    for name, (_, _, placements) in DT2D.items():
        put(state, name, dtensor(full(name, world), mesh2, placements))
    for name in PLAIN:
        put(state, name, full(name, world))
    lo, hi = tri_range(rank)
    put(
        state,
        "irr/rows",
        distckpt.Shard(
            full("irr/rows", world)[lo:hi].clone(), (tri_rows(world), IRR_COLS), (lo, 0)
        ),
    )
    lo, hi = flat_range(world, rank)
    put(
        state,
        "irr/flat",
        distckpt.Shard(full("irr/flat", world)[lo:hi].clone(), (FLAT_LEN,), (lo,)),
    )
    put(state, "per_rank/tensor", distckpt.PerRank(per_rank_tensor(rank)))
    put(state, "per_rank/into_none", distckpt.PerRank(per_rank_tensor2(rank)))
    put(state, "per_rank/value", distckpt.PerRank(per_rank_value(rank)))
    for name, value in VALUES.items():
        put(state, name, value)
    return state


def expected_catalog(n_saved: int) -> list[tuple[str, tuple[int, ...] | None, str]]:
    out = []
    for name in all_names():
        if name.startswith("per_rank/"):
            out.append((name, None, "per_rank"))
        elif name in VALUES:
            out.append((name, None, "value"))
        else:
            t = full(name, n_saved)
            out.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    return out


# ---------------------------------------------------------------------------------------
# Restore targets and their checks
# ---------------------------------------------------------------------------------------


class Checker:
    """Collects failures instead of stopping at the first one."""

    def __init__(self, rank: int, world: int, comm: Any) -> None:
        self.rank, self.world, self.comm = rank, world, comm
        self.failures: list[str] = []
        self.checks = 0

    def fail(self, where: str, message: str) -> None:
        self.failures.append(f"FAIL rank {self.rank}/{self.world} {where}: {message}")

    def tensor(self, where: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.checks += 1
        problem = bits_equal(got, want)
        if problem is not None:
            self.fail(where, problem)

    def value(self, where: str, got: Any, want: Any) -> None:
        self.checks += 1
        if not same_value(got, want):
            self.fail(
                where,
                f"got {got!r} ({type(got).__name__}), expected {want!r} ({type(want).__name__})",
            )

    def run(self, where: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` (which calls collectives on every rank, or raises on every rank)."""
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported, then the remaining checks run
            self.fail(where, "raised\n" + traceback.format_exc())


# A target: (what goes in the state, a function that checks it after the load)
Target = tuple[Any, Callable[[Checker, str], None]]


def dt_target(name: str, want_full: torch.Tensor, mesh: DeviceMesh, placements: Any) -> Target:
    target = dtensor(torch.zeros_like(want_full), mesh, placements)
    want = dtensor(want_full, mesh, placements).to_local()

    def check(c: Checker, where: str) -> None:
        c.tensor(f"{where} {name} DTensor {target.placements} local", target.to_local(), want)

    return target, check


def plain_target(name: str, want_full: torch.Tensor, *, contiguous: bool = True) -> Target:
    if contiguous or want_full.dim() != 2:
        target = torch.zeros_like(want_full)
    else:  # a transposed view: load must copy through a staging buffer
        target = torch.zeros(tuple(reversed(want_full.shape)), dtype=want_full.dtype).t()
        assert not target.is_contiguous()

    def check(c: Checker, where: str) -> None:
        c.tensor(
            f"{where} {name} plain{'' if contiguous else ' non-contiguous'}", target, want_full
        )

    return target, check


def shard_rows_target(name: str, want_full: torch.Tensor, lo: int, hi: int) -> Target:
    box_shape = (hi - lo, *want_full.shape[1:])
    local = torch.zeros(box_shape, dtype=want_full.dtype)
    offsets = (lo,) + (0,) * (want_full.dim() - 1)
    target = distckpt.Shard(local, tuple(want_full.shape), offsets)

    def check(c: Checker, where: str) -> None:
        c.tensor(f"{where} {name} distckpt.Shard rows [{lo}, {hi})", local, want_full[lo:hi])

    return target, check


class Restore:
    """One ``load`` call: a state of targets, and the checks to run after it."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.checks: list[tuple[str, Callable[[Checker, str], None]]] = []

    def add(self, name: str, target: Target) -> None:
        obj, check = target
        put(self.state, name, obj)
        self.checks.append((name, check))

    def add_value(self, name: str, want: Any) -> None:
        put(self.state, name, None)
        state = self.state

        def check(c: Checker, where: str) -> None:
            c.value(f"{where} {name} value", get(state, name), want)

        self.checks.append((name, check))

    def add_per_rank_tensor(self, name: str, want: torch.Tensor, *, prefilled: bool) -> None:
        holder = distckpt.PerRank(torch.zeros_like(want) if prefilled else None)
        original = holder.value
        put(self.state, name, holder)

        def check(c: Checker, where: str) -> None:
            got = holder.value
            if not isinstance(got, torch.Tensor):
                c.fail(f"{where} {name}", f"PerRank holds {type(got).__name__}, expected a tensor")
                return
            if prefilled and got is not original:
                c.fail(f"{where} {name}", "PerRank tensor was replaced, not filled in place")
            c.tensor(
                f"{where} {name} PerRank{' (filled)' if prefilled else ' (from None)'}", got, want
            )

        self.checks.append((name, check))

    def add_per_rank_value(self, name: str, want: Any) -> None:
        holder = distckpt.PerRank(None)
        put(self.state, name, holder)

        def check(c: Checker, where: str) -> None:
            c.value(f"{where} {name} PerRank value", holder.value, want)

        self.checks.append((name, check))

    @property
    def names(self) -> list[str]:
        return sorted(n for n, _ in self.checks)


def restore_same(
    n_saved: int, world: int, rank: int, mesh1: DeviceMesh, mesh2: DeviceMesh
) -> Restore:
    """Every variable, into targets of the same kind (placements on this world size)."""
    r = Restore()
    for name, (_, _, placement) in DT1D.items():
        r.add(name, dt_target(name, full(name, n_saved), mesh1, placement))
    for name, (_, _, placements) in DT2D.items():
        r.add(name, dt_target(name, full(name, n_saved), mesh2, placements))
    for name in PLAIN:
        r.add(name, plain_target(name, full(name, n_saved)))
    rows = full("irr/rows", n_saved)
    r.add(
        "irr/rows", shard_rows_target("irr/rows", rows, *weighted_range(rows.shape[0], world, rank))
    )
    r.add(
        "irr/flat",
        shard_rows_target("irr/flat", full("irr/flat", n_saved), *flat_range(world, rank)),
    )
    source = rank % n_saved  # the documented rule for PerRank across world sizes
    r.add_per_rank_tensor("per_rank/tensor", per_rank_tensor(source), prefilled=True)
    r.add_per_rank_tensor("per_rank/into_none", per_rank_tensor2(source), prefilled=False)
    r.add_per_rank_value("per_rank/value", per_rank_value(source))
    for name, value in VALUES.items():
        r.add_value(name, value)
    return r


def restore_resharded(n_saved: int, mesh1: DeviceMesh) -> Restore:
    """A subset, into other placements."""
    r = Restore()
    r.add("dt/even", dt_target("dt/even", full("dt/even", n_saved), mesh1, DShard(1)))
    r.add("dt/tiny", dt_target("dt/tiny", full("dt/tiny", n_saved), mesh1, Replicate()))
    r.add("dt/cols", dt_target("dt/cols", full("dt/cols", n_saved), mesh1, DShard(0)))
    r.add("big", dt_target("big", full("big", n_saved), mesh1, DShard(1)))
    r.add("irr/rows", dt_target("irr/rows", full("irr/rows", n_saved), mesh1, DShard(0)))
    r.add("irr/flat", plain_target("irr/flat", full("irr/flat", n_saved)))
    r.add("mesh2d/hsdp", dt_target("mesh2d/hsdp", full("mesh2d/hsdp", n_saved), mesh1, DShard(1)))
    r.add("mesh2d/s00", plain_target("mesh2d/s00", full("mesh2d/s00", n_saved)))
    return r


def restore_partial(n_saved: int, world: int, rank: int, mesh1: DeviceMesh) -> Restore:
    """Another subset, other target kinds, plus names the checkpoint does not have."""
    r = Restore()
    r.add("dt/even", dt_target("dt/even", full("dt/even", n_saved), mesh1, Replicate()))
    r.add("dt/uneven", plain_target("dt/uneven", full("dt/uneven", n_saved)))
    r.add("irr/rows", plain_target("irr/rows", full("irr/rows", n_saved)))
    r.add("dt/rep", dt_target("dt/rep", full("dt/rep", n_saved), mesh1, DShard(0)))
    r.add("big", shard_rows_target("big", full("big", n_saved), *weighted_range(256, world, rank)))
    for name in ("plain/bfloat16", "plain/float8_e5m2", "plain/complex64", "plain/bool"):
        r.add(name, plain_target(name, full(name, n_saved), contiguous=False))
    r.add_value("step", VALUES["step"])
    r.add_value("nested", VALUES["nested"])
    return r


PARTIAL_MISSING = {"not/in/ckpt": torch.zeros(2), "not_a_value": None}


# ---------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------


def setup() -> tuple[str, int, int, Any]:
    """(launcher, rank, world size, comm for distckpt) with torch.distributed started."""
    if launched_by_mpi():
        distckpt.comm.init_torch_from_mpi()
        comm: Any = distckpt.comm.MPIComm()
        launcher = "mpiexec"
    elif launched_by_torchrun():
        dist.init_process_group("gloo")
        comm = None  # auto(): the default torch process group
        launcher = "torchrun"
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        comm = distckpt.comm.SingleComm()
        launcher = "single"
    return launcher, dist.get_rank(), dist.get_world_size(), comm


def meshes(world: int, restoring: bool) -> tuple[DeviceMesh, DeviceMesh]:
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh(
        "cpu", mesh_2d_shape(world, restoring), mesh_dim_names=("rep", "shard")
    )
    return mesh1, mesh2


def check_comm(c: Checker, launcher: str, comm: Any) -> None:
    used = comm if comm is not None else distckpt.comm.auto()
    want = {"mpiexec": "MPIComm", "torchrun": "TorchComm", "single": "SingleComm"}[launcher]
    c.value("communicator class", type(used).__name__, want)
    c.value("communicator rank", used.rank, c.rank)
    c.value("communicator size", used.size, c.world)


def check_catalog(c: Checker, path: Path, n_saved: int) -> None:
    got = [(v.name, v.shape, v.dtype) for v in distckpt.list_variables(path)]
    want = expected_catalog(n_saved)
    if got != want:
        missing = [w for w in want if w not in got]
        extra = [g for g in got if g not in want]
        c.fail(f"list_variables({path})", f"not as saved: missing {missing}, unexpected {extra}")
    c.checks += 1


def check_layouts(c: Checker, path: Path, n_saved: int) -> None:
    """The checkpoint exercises the layouts this test claims to cover."""
    from distckpt.format.index import read_index
    from distckpt.format.stored import Pieces

    index = read_index(path)
    variables = index["variables"]
    c.value(f"{path} index world_size", index["world_size"], n_saved)
    c.value(f"{path} dt/even layout", variables["dt/even"]["layout"], "small")
    big = variables["big"]
    c.value(f"{path} big layout", big["layout"], "regular")
    pieces = list(Pieces(big, "big"))
    c.value(f"{path} big pieces", len(pieces), n_saved)
    for piece in pieces:
        inner, block = piece.inner, piece.block
        if inner is None or not inner[0] < block[0]:
            c.fail(f"{path} big", f"a shard without several inner chunks: {piece}")
    codecs = {p.codec.name if p.codec else None for p in pieces}
    c.value(f"{path} big codecs", codecs, {"zstd"})
    codecs = {p.get("codec", {}).get("name") for p in variables["dt/even"]["pieces"]}
    c.value(f"{path} dt/even codecs", codecs, {None})
    flat = variables["irr/flat"]
    c.value(f"{path} irr/flat layout", flat["layout"], "regular" if n_saved == 1 else "boxes")
    if n_saved == 2:  # listed: its second box (300 KB) is above small_bytes: inner chunks
        c.value(f"{path} irr/flat p1 inner", flat["pieces"][1]["inner"] is not None, True)
        c.value(f"{path} irr/flat p1 codec", flat["pieces"][1]["codec"]["name"], "blosc")


def save_into(c: Checker, comm: Any, launcher: str, root: Path) -> None:
    """Save this world's state as ``root/n{world}`` and check its catalog."""
    world, rank = c.world, c.rank
    mesh1, mesh2 = meshes(world, restoring=False)
    path = root / f"n{world}"
    state: dict[str, Any] = {}
    failed = len(c.failures)
    c.run("building the state", lambda: state.update(build_save_state(world, rank, mesh1, mesh2)))

    def save() -> None:
        result = distckpt.save(state, path, comm, inner_bytes=INNER_BYTES, compression=COMPRESSION)
        c.value("SaveResult.path", result.path, path.absolute())

    if len(c.failures) == failed:
        c.run(f"save N={world} ({launcher}) to {path}", save)
    if len(c.failures) == failed:
        c.run("list_variables after save", lambda: check_catalog(c, path, world))


def do(jobs: list[tuple[Path, int]], save_to: Path | None) -> Checker:
    """Restore each of ``jobs`` (a directory and the world size that saved there), then,
    with ``save_to``, save this world's own checkpoint there: one launch does both."""
    launcher, rank, world, comm = setup()
    c = Checker(rank, world, comm)
    check_comm(c, launcher, comm)
    if jobs:
        mesh1, mesh2 = meshes(world, restoring=True)
        for root, n_saved in jobs:
            restore_checkpoint(c, comm, launcher, root / f"n{n_saved}", n_saved, mesh1, mesh2)
    if save_to is not None:
        save_into(c, comm, launcher, save_to)
    return c


def restore_checkpoint(
    c: Checker,
    comm: Any,
    launcher: str,
    path: Path,
    n_saved: int,
    mesh1: DeviceMesh,
    mesh2: DeviceMesh,
) -> None:
    """Every restore of one checkpoint (saved on ``n_saved`` ranks) on this world size."""
    rank, world = c.rank, c.world
    where = f"[{path} N={n_saved} -> M={world} {launcher}]"
    every = all_names()
    c.run(f"{where} list_variables", lambda: check_catalog(c, path, n_saved))
    c.run(f"{where} layouts", lambda: check_layouts(c, path, n_saved))

    # 1. Everything, into targets of the same kinds, strict.
    same = restore_same(n_saved, world, rank, mesh1, mesh2)
    if same.names != every:
        c.fail(where, f"test bug: restore_same covers {same.names}, saved {every}")

    def load_same() -> None:
        result = distckpt.load(same.state, path, comm)
        c.value(f"{where} strict load: loaded", sorted(result.loaded), every)
        c.value(f"{where} strict load: missing", result.missing, [])
        c.value(f"{where} strict load: unexpected", result.unexpected, [])
        for _, check in same.checks:
            check(c, f"{where} strict")

    c.run(f"{where} strict load", load_same)

    # 2-3. Subsets into other placements and kinds, strict=False.
    def load_subset(label: str, restore: Restore, extra: dict[str, Any]) -> None:
        for name, value in extra.items():
            put(restore.state, name, value)
        result = distckpt.load(restore.state, path, comm, strict=False)
        c.value(f"{where} {label}: loaded", sorted(result.loaded), restore.names)
        c.value(f"{where} {label}: missing", sorted(result.missing), sorted(extra))
        c.value(
            f"{where} {label}: unexpected",
            sorted(result.unexpected),
            sorted(set(every) - set(restore.names)),
        )
        for _, check in restore.checks:
            check(c, f"{where} {label}")

    resharded = restore_resharded(n_saved, mesh1)
    c.run(f"{where} resharded load", lambda: load_subset("resharded", resharded, {}))
    partial = restore_partial(n_saved, world, rank, mesh1)
    c.run(f"{where} partial load", lambda: load_subset("partial", partial, PARTIAL_MISSING))

    # 4. strict=True with names that do not match raises, on every rank.
    def strict_refuses() -> None:
        state = {"dt": {"even": torch.zeros(24, 8)}, "nope": torch.zeros(1)}
        try:
            distckpt.load(state, path, comm)
        except distckpt.MissingVariablesError as exc:
            c.value(f"{where} strict mismatch: missing", list(exc.missing), ["nope"])
            c.value(
                f"{where} strict mismatch: unexpected",
                list(exc.unexpected),
                sorted(set(every) - {"dt/even"}),
            )
            return
        except Exception as exc:  # noqa: BLE001 - every rank must raise the same type
            message = f"{type(exc).__name__} instead of MissingVariablesError: {str(exc)[:300]}"
            c.fail(f"{where} strict mismatch", message)
            return
        c.fail(where, "strict load of a mismatching state did not raise MissingVariablesError")

    c.run(f"{where} strict mismatch", strict_refuses)


def parse_jobs(args: list[str]) -> list[tuple[Path, int]]:
    jobs: list[tuple[Path, int]] = []
    root: Path | None = None
    for arg in args:
        if arg.isdigit():
            if root is None:
                raise SystemExit(f"usage: {sys.argv[0]} {USAGE}")
            jobs.append((root, int(arg)))
        else:
            root = Path(arg)
    if not jobs:
        raise SystemExit(f"usage: {sys.argv[0]} {USAGE}")
    return jobs


USAGE = "save DIR | restore DIR N [N ...] [DIR N ...] [save DIR]"


def main(argv: list[str]) -> int:
    save_to: Path | None = None
    if len(argv) >= 2 and argv[-2] == "save":
        save_to, argv = Path(argv[-1]), argv[:-2]
    if argv[:1] == ["restore"] and len(argv) >= 3:
        c = do(parse_jobs(argv[1:]), save_to)
    elif not argv and save_to is not None:
        c = do([], save_to)
    else:
        print(f"usage: {sys.argv[0]} {USAGE}", file=sys.stderr)
        return 2
    if c.failures:
        for line in c.failures:
            say(line)
        say(f"FAILED rank {c.rank}: {len(c.failures)} of {c.checks} checks")
    else:
        say(f"checks {c.rank}: {c.checks}")
    # Every rank finishes its checks before any rank tears the groups down.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if c.failures:
        return 1
    say(f"OK {c.rank}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))

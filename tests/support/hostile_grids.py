"""The ``grids`` family of the hostile fuzzer (``tests/support/hostile_fuzz.py``): index
entries that declare more than they store. A regular variable of the pristine ``ck``
checkpoint is replaced, resealed, by one of:

* ``zero``: a shape with a dimension of zero beside huge ones (up to 64 dimensions), its
  grid declared by chunks of any size, its columns empty (a well-formed empty tensor) or
  lying;
* ``claims``: a huge grid (2**20 shards and far more) whose columns claim to match it:
  short lists, base64 of a few bytes, other types;
* ``count``: a grid of up to 16,384 shards with columns that do match it (lists or
  base64), each shard of any declared size, its files mostly missing;
* ``dims``: 64 dimensions, mostly ones, some huge;
* ``tiny``: a one-byte dtype over a huge shape, in a few huge shards;
* ``listed``: thousands of listed pieces: empty boxes beside a huge dimension, unit boxes
  along one (gaps), one box repeated (overlaps), huge blocks;
* ``chunks``: the shape kept, its chunks or inner chunks replaced (zero, beyond the shape,
  huge, not dividing, of another rank), the columns kept.

Pure crafting (the readers are the fuzzer's): :func:`damage_grids` edits ``root/ck``.
"""

from __future__ import annotations

import base64
import math
import random
from pathlib import Path
from typing import Any

from distckpt.testing.hostile import Crafted

KINDS = ("zero", "claims", "count", "dims", "tiny", "listed", "chunks")
#: Dimensions an attacker picks from: small, huge, at and beyond what a shape may declare.
DIMS = (1, 2, 3, 7, 64, 1000, 2**20, 2**31, 2**40, 2**52, 2**60, 2**61, 2**62 - 1, 2**62, 2**64)
ITEMSIZE = {"w": 4, "zb": 4, "z": 2, "zz": 2}
#: Shards up to which a column that matches its grid is written (about 200 KB of index).
HONEST = 2**14


def _column(rng: random.Random, values: list[int], width: int) -> Any:
    """``values`` as the index writes a column: a list, or base64 of little-endian ints."""
    if len(values) <= 64 and rng.random() < 0.7:
        return values
    return base64.b64encode(b"".join(v.to_bytes(width, "little") for v in values)).decode()


def _lie(rng: random.Random, count: int, width: int) -> Any:
    """A column that does not hold ``count`` entries of ``width`` bytes, or not counts."""
    n = rng.choice([0, 1, 3, 64, 65])
    n = n + 1 if n == count else n
    return rng.choice([
        [rng.randrange(1 << 32) for _ in range(n)],
        base64.b64encode(bytes(width * n)).decode(),
        "not base64!" * rng.randrange(1, 4),
        [-1] * max(count, 1) if count < 1000 else [-1],
        [True] * max(count, 1) if count < 1000 else 5,
        None,
        {"a": 1},
        2**64,
    ])  # fmt: skip


def _sizes(
    rng: random.Random, count: int, block: list[int], itemsize: int, inner: Any
) -> list[int]:
    """Declared sizes of ``count`` shards: right for a plain chunk of ``block`` (so the
    entry passes its checks and reaches the readers), or anything."""
    right = math.prod(block) * itemsize + 4
    pick = rng.choice(["right", "small", "huge", "mixed"])
    if pick == "right" and inner is None and right < 2**62:
        return [right] * count
    if pick == "small":
        return [rng.choice([0, 4, 52, 1024]) for _ in range(count)]
    if pick == "huge":
        return [rng.choice([2**40, 2**61 + 4, 2**62 - 1]) for _ in range(count)]
    return [rng.choice([0, 52, min(right, 2**62 - 1), 2**61]) for _ in range(count)]


def _regular(
    rng: random.Random, entry: dict[str, Any], shape: list[int], chunks: list[int], honest: bool
) -> dict[str, Any]:
    """``entry`` made a regular entry of ``shape`` and ``chunks`` (inner chunks dropped or
    kept as one per shard), with columns that match its grid (when ``honest`` and small
    enough) or lie."""
    grid = [-(-n // c) if c > 0 else 0 for n, c in zip(shape, chunks)]
    count = math.prod(grid)
    inner = None if rng.random() < 0.6 else list(chunks)
    out = {k: v for k, v in entry.items() if k not in ("pieces", "digest", "reused")}
    out.update(layout="regular", shape=shape, chunks=chunks, inner=inner)
    if inner is None:
        out.pop("codec", None)
    if honest and count <= HONEST:
        itemsize = ITEMSIZE.get(entry["path"], 1) if entry["dtype"] != "bool" else 1
        out["crc"] = _column(rng, [rng.randrange(1 << 32) for _ in range(count)], 4)
        out["size"] = _column(rng, _sizes(rng, count, chunks, itemsize, inner), 8)
    else:
        out["crc"] = _lie(rng, count, 4)
        out["size"] = _lie(rng, count, 8) if rng.random() < 0.5 else []
    return out


def _zero(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    ndim = rng.choice([1, 2, 2, 3, 8, 64])
    shape = [1] * ndim
    for d in rng.sample(range(ndim), min(ndim, rng.randrange(1, 4))):
        shape[d] = rng.choice(DIMS)
    shape[rng.randrange(ndim)] = 0
    chunks = [rng.choice([1, 1, 2, max(n, 1), 2**40]) for n in shape]
    honest = rng.random() < 0.7
    return _regular(rng, entry, shape, chunks, honest), f"shape {shape}, chunks {chunks}"


def _claims(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    ndim = rng.choice([1, 2, 3, 64])
    shape = [rng.choice(DIMS[4:12]) if d < 3 else 1 for d in range(ndim)]
    chunks = [1] * ndim
    return _regular(rng, entry, shape, chunks, False), f"shape {shape[:4]}, chunks of one"


def _count(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    grid = [rng.choice([1, 2, 16, 128, 2**14]), rng.choice([1, 2, 8])]
    while math.prod(grid) > HONEST:
        grid[0] //= 2
    chunks = [rng.choice([1, 4, 2**20, 2**26]), rng.choice([1, 48, 2**10])]
    shape = [g * c - rng.choice([0, 0, c - 1]) for g, c in zip(grid, chunks)]
    out = _regular(rng, entry, shape, chunks, True)
    return out, f"grid {grid}, chunks {chunks}, shape {shape}"


def _dims(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    shape = [1] * 64
    for d in rng.sample(range(64), rng.randrange(1, 4)):
        shape[d] = rng.choice([2, 3, 2**20, 2**31, 2**40])
    chunks = [rng.choice([1, n]) if n > 8 else 1 for n in shape]
    honest = rng.random() < 0.8
    return _regular(rng, entry, shape, chunks, honest), f"64 dimensions, {sorted(shape)[-3:]}"


def _tiny(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    dtype = rng.choice(["bool", "uint8", "int8"])
    shape = rng.choice([[2**61, 2], [2**62 - 1], [2**40, 2**20], [2**31, 2**31]])
    shards = rng.choice([1, 2, 4])
    chunks = [-(-shape[0] // shards), *shape[1:]]
    out = _regular(rng, {**entry, "dtype": dtype}, shape, chunks, True)
    return out, f"{dtype} {shape} in {shards} shards"


def _listed(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    n = rng.choice([1000, 5000, 20000])
    kind = rng.choice(["empty", "units", "repeat", "blocks"])
    huge = rng.choice([2**20, 2**40, 2**61])
    pieces = []
    for k in range(n):
        if kind == "empty":
            box, block = [[0, 0], [0, huge]], [1, huge]
        elif kind == "units":
            box, block = [[k, 0], [1, 48]], [1, 48]
        elif kind == "repeat":
            box, block = [[0, 0], [1, 48]], [1, 48]
        else:
            box, block = [[k % 64, 0], [1, 48]], [2**30, 2**20]
        size = math.prod(block) * 4 + 4 if math.prod(block) * 4 < 2**62 else 0
        pieces.append({"file": f"{entry['path']}/c.{k}.0", "box": box, "block": block,
                       "inner": None, "crc": k, "size": size})  # fmt: skip
    shape = [0, huge] if kind == "empty" else [huge if kind == "units" else 64, 48]
    out = {"kind": "tensor", "dtype": entry["dtype"], "shape": shape, "path": entry["path"],
           "layout": "irregular", "pieces": pieces}  # fmt: skip
    return out, f"{n} listed pieces ({kind}), shape {shape}"


def _chunks(rng: random.Random, entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    out = dict(entry)
    ndim = len(entry["shape"])
    if rng.random() < 0.5:
        out["chunks"] = rng.choice([
            [0] * ndim, [2**61] * ndim, [1] * ndim, [*entry["chunks"], 1], [2**40, 1][:ndim],
        ])  # fmt: skip
        what = f"chunks {out['chunks']}"
    else:
        out["inner"] = rng.choice([[0] * ndim, [3] * ndim, [1] * ndim, [1], [2**61] * ndim])
        what = f"inner {out['inner']}"
    return out, what


DAMAGE = {"zero": _zero, "claims": _claims, "count": _count, "dims": _dims, "tiny": _tiny,
          "listed": _listed, "chunks": _chunks}  # fmt: skip


def damage_grids(rng: random.Random, root: Path) -> dict[str, Any]:
    """Replace one regular variable of ``root/ck`` by an entry of a kind of :data:`KINDS`
    (resealed); the fuzzer's record of it."""
    crafted = Crafted(root / "ck")
    var = rng.choice(sorted(ITEMSIZE))
    kind = rng.choice(KINDS)
    entry, what = DAMAGE[kind](rng, crafted.entry(var))
    crafted.edit_index(lambda variables: variables.__setitem__(var, entry))
    return {"damage": f"ck {var}: {kind}: {what}", "readers": "grids", "changed": var}

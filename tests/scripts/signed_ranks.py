"""Signed checkpoints across ranks (run by tests/signing/test_signed_ranks.py under torchrun).

Usage::

    signed_ranks.py save ROOT      # every rank writes its rows; rank 0 signs (key: env)
    signed_ranks.py load ROOT      # any world size: each rank reads its rows, checked
    signed_ranks.py refused ROOT   # every rank must refuse the (tampered) checkpoint

``$DISTCKPT_SIGNING_KEY`` and ``$DISTCKPT_TRUSTED_KEYS`` name the keys. The state: a
weight split by rows (a regular array of one shard a rank), a table split unevenly
(listed pieces), a replicated tensor, a per-rank tensor and a value; every value is a
function of its name, so any rank of any world size knows what its box must hold. Each
rank prints ``OK <rank>`` at the end, or ``REFUSED <rank> <error type>``.
"""

from __future__ import annotations

import sys
import zlib

import torch
from rank import communicator, say

import distckpt

ROWS, COLS = 48, 256
LAYOUT = {"small_bytes": 512, "inner_bytes": 4096}


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(ROWS, COLS if name == "w" else 16, generator=g)


def cut(rank: int, world: int, even: bool) -> tuple[int, int]:
    if not even and world == 2:  # uneven: listed pieces
        return (0, 10) if rank == 0 else (10, ROWS)
    per = -(-ROWS // world)
    return min(rank * per, ROWS), min((rank + 1) * per, ROWS)


def state(rank: int, world: int, blank: bool) -> dict:
    out: dict = {}
    for name, even in (("w", True), ("t", False)):
        a, b = cut(rank, world, even)
        box = full(name)[a:b].clone()
        out[name] = distckpt.Shard(
            torch.zeros_like(box) if blank else box, (ROWS, full(name).shape[1]), (a, 0)
        )
    out["rep"] = torch.zeros(7) if blank else torch.arange(7.0)
    out["mine"] = distckpt.PerRank(torch.zeros(3) if blank else torch.full((3,), float(rank)))
    out["lr"] = None if blank else 0.25
    return out


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    comm = communicator()
    rank, world = comm.rank, comm.size
    if mode == "save":
        distckpt.save(state(rank, world, blank=False), root, comm, **LAYOUT)
        say(f"OK {rank}")
        return
    got = state(rank, world, blank=True)
    try:
        distckpt.load(got, root, comm, strict=False)
    except distckpt.CheckpointError as exc:
        if mode == "refused":
            say(f"REFUSED {rank} {type(exc).__name__}")
            return
        raise
    if mode == "refused":
        raise AssertionError(f"rank {rank} loaded a tampered checkpoint")
    want = state(rank, world, blank=False)
    for name in ("w", "t"):
        assert torch.equal(got[name].tensor, want[name].tensor), name
    assert torch.equal(got["rep"], want["rep"]) and got["lr"] == 0.25
    say(f"OK {rank}")


if __name__ == "__main__":
    main()

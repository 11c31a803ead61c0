"""Incremental saves across ranks (run by tests/engine/test_incremental.py under torchrun).

Usage::

    incremental_ranks.py save RUN      # 2 saves by a manager: the second takes the frozen part
    incremental_ranks.py resume RUN    # restore, then save at once: same world: all taken

The state: a frozen weight split by rows over the ranks (a Shard each), a replicated
frozen tensor, and a trained part that changes every step. Every value is a pure function
of its name and step, so any rank of any world size knows what its box must hold.
Each rank prints ``TOOK <rank> <bytes reused> <bytes written>`` after each save it checks,
and ``OK <rank>`` at the end; a failed check raises, and the job fails.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import torch
from rank import say

import distckpt
from distckpt.comm import auto

ROWS, COLS = 64, 512  # the frozen weight: 128 KiB, several inner chunks a rank
LAYOUT = {"small_bytes": 1024, "inner_bytes": 4096}


def full(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    if name == "frozen":
        return torch.randn(ROWS, COLS, generator=g)
    if name == "emb":
        return torch.randn(32, 64, generator=g)
    return torch.randn(ROWS, 8, generator=g)  # "trained"


def rows(rank: int, world: int) -> tuple[int, int]:
    per = -(-ROWS // world)
    start = min(rank * per, ROWS)
    return start, min(start + per, ROWS)


class Model:
    """What the checkpoint tracks: this rank's boxes of the state at ``step``."""

    def __init__(self, step: int, rank: int, world: int, blank: bool = False) -> None:
        a, b = rows(rank, world)
        self.a = a

        def mine(name: str, s: int) -> torch.Tensor:
            t = full(name, s)[a:b].clone()
            return torch.zeros_like(t) if blank else t

        self.frozen = mine("frozen", 0)  # never trained
        self.trained = mine("trained", step)
        self.emb = torch.zeros(32, 64) if blank else full("emb", 0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "frozen": distckpt.Shard(self.frozen, (ROWS, COLS), (self.a, 0)),
            "trained": distckpt.Shard(self.trained, (ROWS, 8), (self.a, 0)),
            "emb": self.emb,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # filled in place through the Shards

    def check(self, step: int, rank: int, world: int) -> None:
        a, b = rows(rank, world)
        assert torch.equal(self.frozen, full("frozen", 0)[a:b]), "frozen"
        assert torch.equal(self.trained, full("trained", step)[a:b]), "trained"
        assert torch.equal(self.emb, full("emb", 0)), "emb"


def main() -> None:
    what, run = sys.argv[1], sys.argv[2]
    comm = auto()
    rank, world = comm.rank, comm.size
    if what == "save":
        model = Model(1, rank, world)
        ckpt = distckpt.Checkpoint(model=model)
        with distckpt.CheckpointManager(ckpt, run, max_to_keep=1, comm=comm, **LAYOUT) as mgr:
            mgr.save()
            first = mgr.last_result
            assert first is not None and first.bytes_reused == 0
            model.trained.copy_(full("trained", 2)[slice(*rows(rank, world))])
            mgr.save()
            result = mgr.last_result
            assert result is not None
            say(f"TOOK {rank} {result.bytes_reused} {result.bytes_written}")
            # what this rank holds of the frozen weight (and rank 0 the replicated emb)
            assert result.bytes_reused > 0
            assert result.bytes_written < first.bytes_written / 2
    else:
        model = Model(2, rank, world, blank=True)
        ckpt = distckpt.Checkpoint(model=model)
        with distckpt.CheckpointManager(ckpt, run, max_to_keep=1, comm=comm, **LAYOUT) as mgr:
            assert mgr.restore_or_initialize() is not None
            model.check(2, rank, world)
            mgr.save()  # nothing changed since the restore
            result = mgr.last_result
            assert result is not None
            say(f"TOOK {rank} {result.bytes_reused} {result.bytes_written}")
        again = Model(2, rank, world, blank=True)
        distckpt.Checkpoint(model=again).restore(distckpt.latest_checkpoint(run), comm)
        again.check(2, rank, world)
    say(f"OK {rank}")


if __name__ == "__main__":
    main()

"""Saves, loads and a manager through a store added by a plug-in (run by
tests/test_store_plugin.py, which installs the ``files://`` store's package on
``PYTHONPATH``: the scheme is found through its entry point, nothing is imported here).

Usage::

    plugin_ranks.py save RUN    # any world size: RUN/plain, then a manager keeping 1 of 2
    plugin_ranks.py load RUN    # any other world size: both restored, resharded

Every value is a pure function of its name and step, so any rank of any world size knows
what its box must hold; the loads compare bit for bit. A rank whose checks passed prints
``OK <rank>``; a failed check raises, and the job fails.
"""

from __future__ import annotations

import os
import sys
import zlib
from typing import Any

import torch

import distckpt
from distckpt.comm import auto
from distckpt.storage.backend import resolve

SHAPE = (10, 6)  # rows split over the ranks, unevenly on 3 or 4


def full(name: str, step: int) -> torch.Tensor:
    """The global value of variable ``name`` at ``step``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    if name == "w":
        return torch.randn(SHAPE, generator=g)
    if name == "h":
        return torch.randn(7, generator=g).to(torch.bfloat16)
    return torch.randint(-(2**62), 2**62, (5,), generator=g)


def rows(rank: int, world: int) -> tuple[int, int]:
    per = -(-SHAPE[0] // world)
    start = min(rank * per, SHAPE[0])
    return start, min(start + per, SHAPE[0])


def model(step: int, rank: int, world: int, *, blank: bool = False) -> dict[str, Any]:
    """This rank's part of the model at ``step`` (zeros with ``blank``)."""
    a, b = rows(rank, world)
    values = {name: full(name, step) for name in ("w", "h", "ids")}
    if blank:
        values = {name: torch.zeros_like(v) for name, v in values.items()}
    return {
        "w": distckpt.Shard(values["w"][a:b].clone(), SHAPE, (a, 0)),
        "h": values["h"],
        "ids": values["ids"],
    }


def check(got: dict[str, Any], step: int, rank: int, world: int, where: str) -> None:
    want = model(step, rank, world)
    for name in want:
        g, w = got[name], want[name]
        g, w = (g.tensor, w.tensor) if isinstance(g, distckpt.Shard) else (g, w)
        same = g.dtype == w.dtype and g.shape == w.shape
        if not same or not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
            raise AssertionError(f"rank {rank}: {where}: {name} is not step {step}'s, bit for bit")


def main() -> None:
    mode, run = sys.argv[1], sys.argv[2]
    comm = auto()
    rank, world = comm.rank, comm.size
    url = f"files://{os.path.abspath(run)}"
    assert type(resolve(url)).__module__ == "files_store", resolve(url)
    if mode == "save":
        distckpt.save({"model": model(1, rank, world), "step": 1}, f"{url}/plain", comm)
        ckpt = distckpt.Checkpoint(model=model(2, rank, world), step=2)
        with distckpt.CheckpointManager(ckpt, url, max_to_keep=1, comm=comm) as manager:
            manager.save()
            ckpt.model, ckpt.step = model(3, rank, world), 3
            manager.save()
            assert manager.checkpoints == [f"{url}/ckpt-2"], manager.checkpoints
    else:
        got: dict[str, Any] = {"model": model(0, rank, world, blank=True), "step": None}
        distckpt.load(got, f"{url}/plain", comm)
        check(got["model"], 1, rank, world, "plain")
        assert got["step"] == 1, got["step"]
        ckpt = distckpt.Checkpoint(model=model(0, rank, world, blank=True), step=0)
        with distckpt.CheckpointManager(ckpt, url, max_to_keep=1, comm=comm) as manager:
            assert manager.restore_or_initialize() == f"{url}/ckpt-2"
        check(ckpt.model, 3, rank, world, "ckpt-2")
        assert ckpt.step == 3, ckpt.step
    print(f"LATEST {distckpt.latest_checkpoint(url)}", flush=True)
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()

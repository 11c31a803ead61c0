#!/usr/bin/env python
"""The DCP bridge: what ``dcp.save`` / ``dcp.load`` through distckpt cost against DCP's own
files and against distckpt called directly.

State (per job, split over the ranks by rows as FSDP2 does): ``--layers`` float32 weights
of 4096 x 4096 (64 MiB each) and their two Adam moments, as DTensors. Contenders,
alternated within every round (the order rotated each round), each on its own directory
of ``--dir``:

* ``dcp``: ``dcp.save(state, checkpoint_id=...)`` / ``dcp.load`` (FileSystemWriter and
  FileSystemReader defaults);
* ``bridge``: ``dcp.save(state, storage_writer=DistckptWriter(...))`` / ``dcp.load(state,
  storage_reader=DistckptReader(...))``;
* ``distckpt``: ``distckpt.save`` / ``distckpt.load`` of the same state.

Timing: a barrier, each rank's save (or load), a barrier; medians over ``--rounds`` (a
warm-up round first, untimed). Each save goes to a new directory and the one before is
removed. Printed: the time ratios bridge / dcp, bridge / distckpt and distckpt / dcp.

    python benchmarks/bench_bridge.py                      # 2 ranks, /dev/shm
    python benchmarks/bench_bridge.py --world 4 --dir /tmp --rounds 6 --layers 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h

CONTENDERS = ("dcp", "bridge", "distckpt")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import distckpt
    from distckpt.integrations.dcp import DistckptReader, DistckptWriter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n = 4096
    g = torch.Generator().manual_seed(rank)
    local = {
        f"l{k}/{slot}": torch.randn(n // world, n, generator=g)
        for k in range(args.layers)
        for slot in ("weight", "exp_avg", "exp_avg_sq")
    }

    def state() -> dict[str, Any]:
        return {
            name: DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
            for name, t in local.items()
        }

    root = Path(args.root)
    saved: dict[str, list[Path]] = {c: [] for c in CONTENDERS}

    def save(name: str, path: Path) -> None:
        if name == "dcp":
            dcp.save(state(), checkpoint_id=str(path))
        elif name == "bridge":
            dcp.save(state(), storage_writer=DistckptWriter(path))
        else:
            distckpt.save(state(), path)

    def load(name: str, path: Path) -> None:
        target = state()
        if name == "dcp":
            dcp.load(target, checkpoint_id=str(path))
        elif name == "bridge":
            dcp.load(target, storage_reader=DistckptReader(path))
        else:
            distckpt.load(target, path)

    def timed(action: Any, name: str, path: Path) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        action(name, path)
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, dict[str, list[float]]] = {
        op: {c: [] for c in CONTENDERS} for op in ("save", "load")
    }
    for rnd in range(args.rounds + 1):
        order = CONTENDERS[rnd % 3 :] + CONTENDERS[: rnd % 3]
        if (rnd // 3) % 2:
            order = order[::-1]
        for name in order:
            path = root / name / f"s{rnd}"
            took = timed(save, name, path)
            saved[name].append(path)
            loaded = timed(load, name, path)
            if rnd:  # round 0 warms up
                times["save"][name].append(took)
                times["load"][name].append(loaded)
            if rank == 0 and len(saved[name]) > 1:
                shutil.rmtree(saved[name][-2], ignore_errors=True)
            dist.barrier()
    if rank == 0:
        results: dict[str, Any] = {
            op: {c: statistics.median(ts) for c, ts in by.items()} for op, by in times.items()
        }
        results["bytes"] = sum(t.numel() * t.element_size() for t in local.values()) * world
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4, help="4096 x 4096 fp32, 3 slots each")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    root = tempfile.mkdtemp(prefix="bridge-", dir=args.dir)
    job = ["--root", root, "--rounds", str(args.rounds), "--layers", str(args.layers)]
    try:
        got = h.run_rank_job(args.world, __file__, job, args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = got["bytes"] / (1 << 30)
    print(f"{args.world} ranks, {gib:.2f} GiB, {args.dir}, medians of {args.rounds} rounds")
    print(f"{'op':5s} {'bridge/dcp':>10s} {'bridge/distckpt':>15s} {'distckpt/dcp':>12s}  (time)")
    for op in ("save", "load"):
        t = got[op]
        print(
            f"{op:5s} {t['bridge'] / t['dcp']:10.3f} {t['bridge'] / t['distckpt']:15.3f} "
            f"{t['distckpt'] / t['dcp']:12.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **got}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

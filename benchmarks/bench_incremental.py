#!/usr/bin/env python
"""Incremental saves: a LoRA-style state saved every few steps, distckpt incremental vs
distckpt full vs DCP.

State (per job, split over the ranks by rows): a frozen base of ``--layers`` float32
weights of 4096 x 4096 (1 GiB for 16 layers), and per layer LoRA adapters A (4096 x r) and
B (r x 4096) with their Adam moments (``exp_avg``, ``exp_avg_sq``): about 2% of the bytes
for r = 16. Each step adds to the adapters and their moments, never to the base.

Contenders, alternated within every round (the order rotated each round), each on its own
directory of ``--dir``:

* ``incremental``: a ``CheckpointManager(max_to_keep=2, delete_in_background=True)``
  (incremental by default): each save builds on the previous one and takes the unchanged
  pieces by hard link; the checkpoint that falls out is removed off the save path
  (``--delete-inline``: on it, as before 2026-11-29);
* ``full``: the same manager with ``incremental=False``: every byte written;
* ``dcp``: ``torch.distributed.checkpoint.save`` of the same state (a new directory each
  save, the previous one removed).

Then the same with *everything* changed (the base too), where the incremental save gains
nothing: the cost of deciding. Timing: a barrier, each rank's save, a barrier; the time is
the slowest rank's (``max``), medians over ``--rounds`` (a warm-up round first, untimed).
Bytes: what each rank's ``SaveResult`` says it wrote (summed), against the stored bytes of
the pieces that changed (from the index). The driver launches ``torchrun`` once per world
size and directory and prints ratios; ``--json FILE`` keeps them.

    python benchmarks/bench_incremental.py                     # 1 and 4 ranks, /dev/shm and /tmp
    python benchmarks/bench_incremental.py --worlds 4 --dirs /tmp --rounds 5 --layers 16
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

CONTENDERS = ("incremental", "full", "dcp")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import distckpt
    from distckpt.comm import TorchComm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = TorchComm()
    mesh = init_device_mesh("cpu", (world,))
    n, r = 4096, args.rank
    rows = n // world
    g = torch.Generator().manual_seed(rank)

    def sharded(t: torch.Tensor, dim: int) -> Any:
        """This rank's part, as the DTensor of the whole (FSDP-style, split on ``dim``)."""
        return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)

    base = [torch.randn(rows, n, generator=g) for _ in range(args.layers)]
    adapters = {
        f"l{k}/{name}": torch.randn(rows, r, generator=g) * 0.01
        for k in range(args.layers)
        for name in ("a", "a_m", "a_v")
    } | {
        f"l{k}/{name}": torch.randn(r, n // world, generator=g) * 0.01
        for k in range(args.layers)
        for name in ("b", "b_m", "b_v")
    }

    def state() -> dict[str, Any]:
        out: dict[str, Any] = {f"base/l{k}": sharded(w, 0) for k, w in enumerate(base)}
        for name, t in adapters.items():
            out[f"lora/{name}"] = sharded(t, 0 if name.split("/")[1].startswith("a") else 1)
        return out

    class Holder:
        """What a manager's Checkpoint saves: the state above, by name."""

        def state_dict(self) -> dict[str, Any]:
            return state()

        def load_state_dict(self, _: Any) -> None:  # never restored here
            raise NotImplementedError

    root = Path(args.root)
    managers = {}
    for name in ("incremental", "full"):
        ckpt = distckpt.Checkpoint(model=Holder())
        managers[name] = distckpt.CheckpointManager(
            ckpt,
            root / name,
            max_to_keep=2,
            comm=comm,
            incremental=name == "incremental",
            delete_in_background=not args.delete_inline,
        )

    def step(everything: bool) -> None:
        with torch.no_grad():
            for t in adapters.values():
                t.add_(1e-3)
            if everything:
                for w in base:
                    w.add_(1e-3)

    dcp_dirs: list[Path] = []

    def save(name: str) -> tuple[float, int]:
        dist.barrier()
        t0 = time.perf_counter()
        if name == "dcp":
            path = root / "dcp" / f"s{len(dcp_dirs)}"
            dcp.save(state(), checkpoint_id=str(path))
            dcp_dirs.append(path)
            written = sum(t.numel() * t.element_size() for t in [*base, *adapters.values()])
        else:
            manager = managers[name]
            manager.save(check_interval=False)
            assert manager.last_result is not None
            written = manager.last_result.bytes_written
        dist.barrier()
        took = time.perf_counter() - t0
        if name == "dcp" and rank == 0 and len(dcp_dirs) > 1:
            shutil.rmtree(dcp_dirs[-2], ignore_errors=True)
        return took, written

    results: dict[str, Any] = {}
    for phase in ("adapters", "everything"):
        times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        wrote: dict[str, list[int]] = {c: [] for c in CONTENDERS}
        for rnd in range(args.rounds + 1):
            step(everything=phase == "everything")
            order = CONTENDERS[rnd % 3 :] + CONTENDERS[: rnd % 3]
            for name in order:
                took, written = save(name)
                if rnd:  # round 0 warms up (and makes each manager's first, full save)
                    times[name].append(took)
                    wrote[name].append(written)
        totals = [torch.tensor(sum(w) // max(1, len(w))) for w in wrote.values()]
        for t in totals:
            dist.all_reduce(t)
        results[phase] = {
            c: {"seconds": statistics.median(times[c]), "bytes": int(t)}
            for c, t in zip(CONTENDERS, totals, strict=True)
        }
    if rank == 0:
        changed = sum(t.numel() * t.element_size() for t in adapters.values()) * world
        results["changed_bytes"] = changed  # raw bytes of what a step changes
        results["total_bytes"] = changed + sum(w.numel() * 4 for w in base) * world
        Path(args.out).write_text(json.dumps(results))
    for m in managers.values():
        m.close()
    dist.destroy_process_group()


def launch(world: int, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="incr-", dir=directory)
    job = [
        "--root", root, "--rounds", str(args.rounds), "--layers", str(args.layers),
        "--rank", str(args.r), *(["--delete-inline"] if args.delete_inline else []),
    ]  # fmt: skip
    try:
        return dict(h.run_rank_job(world, __file__, job, args.timeout))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dirs", nargs="+", default=["/dev/shm", "/tmp"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16, help="4096 x 4096 fp32 each")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument(
        "--delete-inline",
        action="store_true",
        help="the managers delete retired checkpoints on the save path (default: in the "
        "background, as DCP's removal of its previous directory is not timed either)",
    )
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    report: dict[str, Any] = {}
    print(
        f"{'dir':10s} {'ranks':>5s} {'case':10s} {'incr/full':>9s} {'incr/dcp':>8s} "
        f"{'full/dcp':>8s} {'incr bytes/changed':>18s}"
    )
    for directory in args.dirs:
        for world in args.worlds:
            got = launch(world, directory, args)
            report[f"{directory}/{world}"] = got
            for phase in ("adapters", "everything"):
                p = got[phase]
                wanted = got["changed_bytes"] if phase == "adapters" else got["total_bytes"]
                print(
                    f"{directory:10s} {world:5d} {phase:10s} "
                    f"{p['incremental']['seconds'] / p['full']['seconds']:9.3f} "
                    f"{p['incremental']['seconds'] / p['dcp']['seconds']:8.3f} "
                    f"{p['full']['seconds'] / p['dcp']['seconds']:8.3f} "
                    f"{p['incremental']['bytes'] / wanted:18.3f}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

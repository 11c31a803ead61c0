"""Coordination at scale with real processes (run by tests/engine/test_scale.py).

Usage::

    scale_ranks.py DIR        # any world size (even): every case below, in DIR

Cases, each checked on every rank:

* ``reuse``: three saves of one state (its values change) plan once and reuse the plan
  after; a new variable makes a new plan; every checkpoint restores bit for bit.
* ``sampled``: with ``DISTCKPT_REPLICA_CHECK=2`` a replicated tensor that differs on one
  rank is caught within two saves of a reused plan, naming it; nothing is committed.
* ``replicated``: a load of fully replicated state (1,000 small tensors, two large ones
  and a few of odd sizes and dtypes) reads every stored byte once over all ranks, the
  rest being exchanged.
* ``hsdp``: two replicas of a row-sharded state (ranks r and r + world/2 hold the same
  box) read each stored byte once too.

Each rank prints ``CASE {json}`` with its byte counts, ``FAIL <case> <rank>: <why>`` for
a failed check, and ``OK <rank>`` at the end if every check passed.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from rank import Runner, communicator

import distckpt
from distckpt.comm.auto import launched_by_torchrun
from distckpt.errors import ValidationError
from distckpt.format.index import read_index
from distckpt.format.stored import Pieces

SMALL = 1000  # replicated small tensors of 48 x 64 float32 (12 KiB: plain chunks)
BIG = {"big/a": (1024, 1024), "big/b": (700, 513)}  # replicated, several inner chunks
INNER = 256 * 1024


def generate(key: object, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def replicated_state(seed: int) -> dict[str, Any]:
    state: dict[str, Any] = {
        f"small/{i}": generate(("small", i, seed), (48, 64)) for i in range(SMALL)
    }
    state.update({name: generate((name, seed), shape) for name, shape in BIG.items()})
    # Odd sizes and dtypes travel packed together: each must land aligned.
    x = generate(("odd", seed), (16,))
    state["odd/f64"] = x[0].double()
    state["odd/c128"] = torch.complex(x[1:4].double(), x[4:7].double())
    state["odd/bool"] = x[:7] > 0
    state["odd/bf16"] = x[:15].reshape(5, 3).bfloat16()
    state["odd/i8"] = (x[:9] * 50).to(torch.int8)
    return state


def stored_bytes(path: Path) -> int:
    variables = read_index(path)["variables"]
    return sum(
        Pieces(entry, name).stored_bytes
        for name, entry in variables.items()
        if entry.get("kind") == "tensor"
    )


def header_bytes(path: Path) -> int:
    """Bytes of the shard indexes and checksum tables: read by every rank reading a shard."""
    variables = read_index(path)["variables"]
    total = 0
    for name, entry in variables.items():
        if entry.get("kind") != "tensor":
            continue
        for p in Pieces(entry, name):
            if p.inner is not None:
                chunks = 1
                for b, i in zip(p.block, p.inner, strict=True):
                    chunks *= -(-b // i)
                total += chunks * (16 + 4) + 8
    return total


def main(root: Path) -> int:
    comm = communicator()
    rank, world = comm.rank, comm.size
    run = Runner(comm)

    def reuse() -> dict[str, Any]:
        reused = []
        for step in range(3):
            state = {**replicated_state(0), "step": step}
            result = distckpt.save(state, root / f"reuse-{step}", comm, inner_bytes=INNER)
            reused.append(result.plan_reused)
        state = {**replicated_state(0), "step": 3, "extra": torch.ones(3)}
        reused.append(distckpt.save(state, root / "reuse-3", comm).plan_reused)
        run.check("reuse", reused == [False, True, True, False], f"reused: {reused}")
        for step in (2, 3):
            target: dict[str, Any] = {
                k: torch.zeros_like(v) for k, v in replicated_state(0).items()
            }
            target["step"] = None
            if step == 3:
                target["extra"] = torch.zeros(3)
            distckpt.load(target, root / f"reuse-{step}", comm)
            run.check("reuse", target["step"] == step, f"step {target['step']} != {step}")
            for name, want in replicated_state(0).items():
                run.check("reuse", torch.equal(target[name], want), f"{name} of reuse-{step}")
        return {"reused": reused}

    def sampled() -> dict[str, Any]:
        os.environ["DISTCKPT_REPLICA_CHECK"] = "2"
        caught = None
        try:
            for attempt in range(1, 4):
                state = {"a": torch.zeros(8), "b": torch.zeros(8), "c": torch.zeros(8)}
                if attempt > 1 and rank == world - 1:
                    state["b"] = torch.ones(8)  # differs from the first reused save on
                try:
                    distckpt.save(state, root / f"sampled-{attempt}", comm)
                except ValidationError as exc:
                    caught = attempt
                    run.check("sampled", "'b'" in str(exc), str(exc))
                    run.check("sampled", not (root / f"sampled-{attempt}").exists(), "committed")
                    break
        finally:
            del os.environ["DISTCKPT_REPLICA_CHECK"]
        run.check("sampled", caught in (2, 3), f"caught at save {caught}")
        return {"caught": caught}

    def replicated() -> dict[str, Any]:
        path = root / "replicated"
        distckpt.save(replicated_state(1), path, comm, inner_bytes=INNER)
        target = {k: torch.zeros_like(v) for k, v in replicated_state(1).items()}
        result = distckpt.load(target, path, comm)
        for name, want in replicated_state(1).items():
            run.check("replicated", torch.equal(target[name], want), name)
        return _counts(path, result)

    def hsdp() -> dict[str, Any]:
        half = world // 2
        shard = rank % half
        path = root / "hsdp"
        rows = 64 * half

        def state_of(seed: int) -> dict[str, Any]:
            full = generate(("hsdp", seed), (rows, 4096))  # 1 MiB per shard
            block = full[shard * 64 : (shard + 1) * 64].clone()
            return {"w": distckpt.Shard(block, (rows, 4096), (shard * 64, 0))}

        distckpt.save(state_of(2), path, comm, inner_bytes=INNER)
        target = state_of(2)
        want = target["w"].tensor.clone()
        target["w"].tensor.zero_()
        result = distckpt.load(target, path, comm)
        run.check("hsdp", torch.equal(target["w"].tensor, want), "w")
        return _counts(path, result)

    def _counts(path: Path, result: distckpt.LoadResult) -> dict[str, Any]:
        return {
            "read": result.bytes_read,
            "exchanged": result.bytes_exchanged,
            "stored": stored_bytes(path),
            "headers": header_bytes(path),
        }

    for name, fn in (("reuse", reuse), ("sampled", sampled), ("replicated", replicated)):
        run.measure(name, fn)
    if world % 2 == 0:
        run.measure("hsdp", hsdp)
    comm.barrier()
    status = run.finish()
    if launched_by_torchrun():  # every group (the exchange's too) torn down together: a
        import torch.distributed as dist  # rank that exits with them alive can abort another

        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(Path(sys.argv[1])))

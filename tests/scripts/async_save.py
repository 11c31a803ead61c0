"""Background saves on several ranks (under mpiexec or torchrun).

Usage: async_save.py DIR

Every rank holds a row-sharded tensor (a :class:`distckpt.Shard`), a replicated tensor
and a per-rank value. Cases, in the same order on every rank:

* ``overlap``: a background save, while the training thread runs its own collectives on
  the job's communicator (torch.distributed ``all_reduce`` on the default group, or MPI
  ``allreduce`` on ``COMM_WORLD``) and changes every tensor in place; the checkpoint
  restores, bit for bit, the values as of the call to ``save``;
* ``lazy``: a lazy save, ``wait_snapshot``, then the tensors change; same check;
* ``manager``: three background saves through a :class:`distckpt.CheckpointManager` with
  ``max_to_keep=2`` and an optimizer stepped between them; ``latest`` and the retained
  checkpoints are right once synced, and the newest restores bit for bit;
* ``error``: a background save whose replicated tensor differs on the last rank: nobody
  waits, and the next save raises the validation error on every rank, then works.

Each rank prints ``OK <rank>`` when every check passed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from rank import say

import distckpt
from distckpt.errors import CheckpointError

ROWS, COLS = 64, 1000


def training_collective(value: float) -> float:
    """A collective on the job's own communicator, as training would run one."""
    import torch.distributed as dist

    if dist.is_initialized():
        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t.item())
    from mpi4py import MPI

    return float(MPI.COMM_WORLD.allreduce(value))


def state_of(rank: int, world: int, seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(ROWS * world, COLS, generator=gen)
    mine = full[rank * ROWS : (rank + 1) * ROWS].clone()
    return {
        "w": distckpt.Shard(mine, (ROWS * world, COLS), (rank * ROWS, 0)),
        "r": torch.randn(4096, generator=gen),
        "me": distckpt.PerRank(rank),
    }


def snapshot(state: dict[str, object]) -> dict[str, object]:
    w = state["w"]
    r = state["r"]
    assert isinstance(w, distckpt.Shard) and isinstance(r, torch.Tensor)
    return {"w": w.tensor.clone(), "r": r.clone()}


def change(state: dict[str, object]) -> None:
    w = state["w"]
    r = state["r"]
    assert isinstance(w, distckpt.Shard) and isinstance(r, torch.Tensor)
    w.tensor.mul_(-3.0).add_(1.0)
    r.add_(7.0)


def check_restored(path: str, expected: dict[str, object], rank: int, world: int) -> None:
    target = state_of(rank, world, seed=999)  # other values, same layout
    distckpt.load(target, path)
    w = target["w"]
    assert isinstance(w, distckpt.Shard)
    assert torch.equal(w.tensor, expected["w"]), f"{path}: w differs"  # type: ignore[arg-type]
    assert torch.equal(target["r"], expected["r"]), f"{path}: r differs"  # type: ignore[arg-type]
    me = target["me"]
    assert isinstance(me, distckpt.PerRank) and me.value == rank, me


def main() -> None:
    base = Path(sys.argv[1])
    comm = distckpt.comm.auto()
    rank, world = comm.rank, comm.size

    # overlap: training collectives and in-place changes while the save runs
    state = state_of(rank, world, seed=1)
    expected = snapshot(state)
    handle = distckpt.save(state, base / "overlap", comm, async_save=True)
    total = 0.0
    for i in range(20):
        total += training_collective(float(i + rank))
        change(state)
    assert total == sum(sum(i + r for r in range(world)) for i in range(20)), total
    result = handle.wait()
    assert handle.done() and result.timings["snapshot"] < result.timings["total"] + 1.0
    check_restored(str(base / "overlap"), expected, rank, world)

    # lazy: nothing copied before return; the copy is awaited before changing
    state = state_of(rank, world, seed=2)
    expected = snapshot(state)
    handle = distckpt.save(state, base / "lazy", comm, async_save=True, lazy=True)
    training_collective(1.0)
    handle.wait_snapshot()
    change(state)
    handle.wait()
    check_restored(str(base / "lazy"), expected, rank, world)

    # manager: retention and pointer happen in the background, settled by sync()
    model = torch.nn.Linear(8, 4)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
    manager = distckpt.CheckpointManager(ckpt, base / "run", max_to_keep=2, comm=comm)
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        handle = manager.save(async_save=True)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        training_collective(0.0)
    manager.sync()
    names = [Path(p).name for p in manager.checkpoints]
    assert names == ["ckpt-2", "ckpt-3"], names
    assert distckpt.latest_checkpoint(base / "run") == str(base / "run" / "ckpt-3")
    listed = sorted(n for n in os.listdir(base / "run") if not n.startswith("."))
    assert listed == ["ckpt-2", "ckpt-3", "latest"], listed
    fresh = torch.nn.Linear(8, 4)
    distckpt.Checkpoint(model=fresh).restore(handle.path).expect_partial()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    manager.close()

    # error: raised at the next call on every rank, once. The plan is reused, which checks
    # a rotating share of the replicated tensors at each save: here, every one.
    os.environ["DISTCKPT_REPLICA_CHECK"] = "1"
    state = state_of(rank, world, seed=3)
    if rank == world - 1:
        state["r"] = torch.zeros(4096)  # replicated tensor differs here
    distckpt.save(state, base / "bad", comm, async_save=True)
    training_collective(0.0)
    try:
        distckpt.save(state_of(rank, world, seed=4), base / "next", comm)
    except CheckpointError as exc:
        assert "'r'" in str(exc), exc
    else:
        raise AssertionError("the background error was not raised at the next call")
    assert not (base / "bad").exists()
    distckpt.save(state_of(rank, world, seed=4), base / "next", comm)  # works again
    say(f"OK {rank}")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        say(f"FAILED:\n{traceback.format_exc()}")
        sys.stdout.flush()
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

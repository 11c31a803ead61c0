"""A training job with a node-local tier, for tests/local/test_local_tier.py.

Run under mpiexec or torchrun (any world size that divides 8), as 2 "nodes":
``$DISTCKPT_NODE`` set per node by the launcher, or ``--node-of-rank`` (the node of rank
``r`` is ``n{r // 2}``). Saves every step: persistently every ``--persistent-every``
steps to ``--run``, node-locally (one replica) the other steps to ``--tier``
(``{node}`` in it becomes each node's name).

The state is updated elementwise from the step and each element's global index, so a
resumed run on any world size must end bit for bit where an uninterrupted one does;
at the end every rank replays the whole run for its own boxes and compares.

Failure injection:
* ``--kill-node N --kill-at K``: after the save of step K, the ranks of node ``N`` delete
  that node's local directory (the node is lost) and SIGKILL themselves. Only in the
  first attempt on a run directory (a ``killed`` file marks later ones), so a relaunch
  goes on.
* ``--die-in-save-at K``: rank 1 SIGKILLs itself in the middle of the local save of step
  K (its data written, before the ranks confirm the step). Also only once.

Prints ``RESTORED {json}`` on rank 0 and ``OK <rank>`` per rank when every value matches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys

import torch

import distckpt
from distckpt.local import nodes
from distckpt.slices import chunk_bounds

W_SHAPE = (8, 6)
E_SHAPE = (10, 3)


def initial(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=dtype).reshape(shape) / 7


def update(t: torch.Tensor, step: int, rows: tuple[int, int]) -> None:
    """One training step on rows ``rows`` of a global tensor: elementwise, exact."""
    index = torch.arange(rows[0], rows[1], dtype=t.dtype).reshape(-1, *([1] * (t.dim() - 1)))
    t.mul_(0.75).add_(index * 0.125 + step / 64)


def say(line: str) -> None:
    """One whole line in one write: ranks' lines never interleave."""
    os.write(1, (line + "\n").encode())


def rows(length: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [lo, hi) rank ``index`` of ``parts`` holds (torch.chunk's split)."""
    start, size = chunk_bounds(length, parts, index)
    return start, start + size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", "--dir", required=True)
    ap.add_argument("--tier", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--persistent-every", type=int, default=10)
    ap.add_argument("--node-of-rank", action="store_true")
    ap.add_argument("--kill-node", default=None)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--die-in-save-at", type=int, default=-1)
    ap.add_argument("--async-save", action="store_true")
    args = ap.parse_args()

    comm = distckpt.comm.auto(timeout=float(os.environ.get("DISTCKPT_TIMEOUT", "20")))
    rank, size = comm.rank, comm.size
    if args.node_of_rank:
        os.environ[nodes.NODE_ENV] = f"n{rank // 2}"
    node = nodes.node_identity()

    w_rows = rows(W_SHAPE[0], size, rank)
    e_rows = rows(E_SHAPE[0], size, rank)
    w = initial(W_SHAPE, torch.float32)[w_rows[0] : w_rows[1]].clone()
    e = initial(E_SHAPE, torch.float64)[e_rows[0] : e_rows[1]].clone()
    bias = torch.zeros(5, dtype=torch.bfloat16)
    step = torch.tensor(0)
    counter = torch.zeros(1, dtype=torch.int64)
    ckpt = distckpt.Checkpoint(
        step=step,
        w=distckpt.Shard(w, W_SHAPE, (w_rows[0], 0)),
        e=distckpt.Shard(e, E_SHAPE, (e_rows[0], 0)),
        bias=bias,
        counter=distckpt.PerRank(counter),
        meta={"lr": 0.0},
    )
    tier = distckpt.LocalTier(args.tier, replicas=1, max_to_keep=2)
    manager = distckpt.CheckpointManager(
        ckpt,
        args.run,
        max_to_keep=2,
        checkpoint_interval=args.persistent_every,
        step_counter=step,
        comm=comm,
        local=tier,
    )
    manager.restore_or_initialize()
    restored = manager.restored
    counter = ckpt.counter.value  # a restore replaces the value a PerRank holds
    if rank == 0:
        record = (
            None
            if restored is None
            else {
                "tier": restored.tier,
                "number": restored.number,
                "reason": restored.reason,
            }
        )
        say("RESTORED " + json.dumps({**(record or {"tier": None}), "world": size}))

    marker = os.path.join(args.run, "killed")
    first_attempt = not os.path.exists(marker)
    if args.die_in_save_at >= 0 and rank == 1 and first_attempt:
        from distckpt.local import save as local_save

        replicate = local_save._replicate

        def dying(*a, **k):  # type: ignore[no-untyped-def]
            if int(step) == args.die_in_save_at:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return replicate(*a, **k)

        local_save._replicate = dying

    while int(step) < args.steps:
        step.add_(1)
        s = int(step)
        update(w, s, w_rows)
        update(e, s, e_rows)
        bias.add_(1)
        counter.add_(rank + 1)
        ckpt.meta = {"lr": s / 100}
        handle = manager.save(async_save=args.async_save)
        if args.async_save and handle is not None:
            handle.wait()
        if s == args.kill_at and first_attempt and args.kill_node is not None:
            comm.barrier()  # every rank has marked step s: it is committed
            if node == args.kill_node:
                open(marker, "w").close()
                shutil.rmtree(tier.path(), ignore_errors=True)
                say(f"KILLED {rank} at {s}")
                os.kill(os.getpid(), signal.SIGKILL)
    manager.close()

    # An uninterrupted run of the same steps, for this rank's boxes.
    w_ref = initial(W_SHAPE, torch.float32)[w_rows[0] : w_rows[1]].clone()
    e_ref = initial(E_SHAPE, torch.float64)[e_rows[0] : e_rows[1]].clone()
    for s in range(1, args.steps + 1):
        update(w_ref, s, w_rows)
        update(e_ref, s, e_rows)
    checks = {
        "w": torch.equal(w.view(torch.int32), w_ref.view(torch.int32)),
        "e": torch.equal(e.view(torch.int64), e_ref.view(torch.int64)),
        "bias": torch.equal(bias, torch.full((5,), float(args.steps), dtype=torch.bfloat16)),
        "step": int(step) == args.steps,
        "counter": int(counter[0]) == args.steps * (rank + 1),
        "meta": ckpt.meta == {"lr": args.steps / 100},
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        say(f"FAIL {rank}: {bad} w={w.tolist()} ref={w_ref.tolist()}")
        return 1
    say(f"OK {rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

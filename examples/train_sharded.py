"""Sharded training that survives interruptions and changes of world size.

A small MLP, sharded with FSDP2 (``fully_shard``) over every rank, learns a synthetic
regression with AdamW. Every ``--every`` steps, and at the end, a
:class:`distckpt.CheckpointManager` saves the model, the optimizer, the step counter and
the data position; a relaunch restores the newest checkpoint (whatever world size saved
it) and carries on where the last run stopped::

    python examples/train_sharded.py --dir run                           # one process
    mpiexec -n 4 python examples/train_sharded.py --dir run --stop-after 10
    torchrun --standalone --nproc-per-node 2 examples/train_sharded.py --dir run

**Data.** Sample ``i`` is a deterministic function of ``i`` alone (its own generator,
seeded by ``i``), so the data position is one global sample counter. At step ``s`` the
global batch is samples ``[s*B, (s+1)*B)``; rank ``r`` of ``W`` takes its contiguous
``B/W`` slice.

**Loss scaling.** Each rank's loss is the mean over its own ``B/W`` samples. FSDP2
*averages* the gradients over the ``W`` ranks in its reduce-scatter, so every rank ends up
with ``(1/W) * sum_r (W/B) * sum_{i in r} grad_i = (1/B) * sum_i grad_i``: the gradient of
the mean over the global batch, whatever ``W`` (up to float rounding, which depends on the
reduction order).

**Preemption.** ``SIGTERM`` or ``SIGUSR1`` on any rank (a cluster's preemption notice,
``scontrol requeue``, torchrun passing on its own ``SIGTERM``) makes every rank save at
the next step boundary and exit with code 75 (``distckpt.EXIT_PREEMPTED``); the scripts
in ``launch/`` relaunch or requeue the job on that code, and the next run resumes.

``--save-mode async`` writes checkpoints in the background after copying the state to
host memory; ``lazy`` does not even copy parameters and optimizer state before returning
(the copy runs during the next forward and backward; ``optimizer.step()`` waits for it).

``--dump PATH`` makes rank 0 write, at the end, every parameter and AdamW slot as a full
tensor (``torch.save``); ``--check-restore-against PATH`` compares, right after the
restore, the restored state with such a dump, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distckpt

IN, HIDDEN, OUT = 16, 64, 1
#: Never wraps: the data are an endless stream of distinct samples.
DATASET_SIZE = 2**62


# ---------------------------------------------------------------- launch


def setup() -> tuple[int, int, Any]:
    """Start torch.distributed under torchrun or mpiexec; return (rank, world, mesh).

    One process (plain ``python``): no process group, no mesh, no sharding.
    """
    import torch.distributed as dist

    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
        dist.init_process_group("gloo")
    elif any(k.startswith(("PMI_", "OMPI_", "PMIX_")) for k in os.environ):
        distckpt.comm.init_torch_from_mpi()
    if not dist.is_initialized():
        return 0, 1, None
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return dist.get_rank(), world, init_device_mesh("cpu", (world,))


# ---------------------------------------------------------------- model and data


def build_model(mesh: Any, seed: int = 0) -> nn.Module:
    """The MLP, initialized identically on every rank, then sharded over ``mesh``."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN), nn.ReLU(), nn.Linear(IN, OUT)
    )
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _target_weights() -> torch.Tensor:
    return torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234))


TRUE_W = _target_weights()


def samples(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``start .. stop-1``: ``x_i`` from a generator seeded by ``i``, ``y = x W``."""
    xs = torch.stack(
        [torch.randn(IN, generator=torch.Generator().manual_seed(i)) for i in range(start, stop)]
    )
    return xs, xs @ TRUE_W


# ---------------------------------------------------------------- full state (for tests)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a (possibly DTensor) tensor; collective for DTensors."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """Every parameter and AdamW slot as a full tensor, keyed by name. Collective."""
    out: dict[str, Any] = {"step": step}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = _full(p)
        for slot, value in sorted(opt.state.get(p, {}).items()):
            out[f"opt:{name}:{slot}"] = _full(value) if torch.is_tensor(value) else value
    return out


def compare(got: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The keys that differ (not bit-identical), or are missing on either side."""
    bad = sorted(set(got) ^ set(expected))
    for key in sorted(set(got) & set(expected)):
        a, b = got[key], expected[key]
        if torch.is_tensor(a) and torch.is_tensor(b):
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            same = a == b
        if not same:
            bad.append(key)
    return bad


# ---------------------------------------------------------------- training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="train_sharded_ckpt", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=30, help="total steps to reach")
    parser.add_argument("--every", type=int, default=5, help="save every this many steps")
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step, all ranks")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--stop-after", type=int, default=None, help="stop after this many steps of this run"
    )
    parser.add_argument("--max-to-keep", type=int, default=5)
    parser.add_argument(
        "--save-mode",
        choices=("sync", "async", "lazy"),
        default="sync",
        help="blocking saves, background saves, or lazy background saves",
    )
    parser.add_argument(
        "--local-dir",
        default=None,
        help="node-local tier ({node}: the node's name): saves go there between persistent ones",
    )
    parser.add_argument(
        "--persistent-every",
        type=int,
        default=None,
        help="with --local-dir: save to --dir every this many steps (default: 4 x --every)",
    )
    parser.add_argument("--dump", default=None, help="rank 0 writes the full state here at the end")
    parser.add_argument(
        "--check-restore-against",
        default=None,
        help="compare the restored state with this --dump file, bit for bit",
    )
    args = parser.parse_args()

    rank, world, mesh = setup()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")
    local_batch = args.global_batch // world

    model = build_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    step = torch.tensor(0, dtype=torch.int64)
    # The cursor walks the global batches (world_size 1: every rank sees the whole batch
    # and takes its contiguous slice); its position is saved once and restores anywhere.
    cursor = distckpt.SampleCursor(DATASET_SIZE, args.global_batch)
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt, step=step, data=cursor)
    local = None
    if args.local_dir is not None:  # frequent node-local saves, copied to a peer node
        local = distckpt.LocalTier(args.local_dir, replicas=1, max_to_keep=2)
    manager = distckpt.CheckpointManager(
        ckpt,
        args.dir,
        max_to_keep=args.max_to_keep,
        step_counter=step,
        checkpoint_interval=None if local is None else args.persistent_every or 4 * args.every,
        local=local,
    )

    restored = manager.restore_or_initialize()
    if restored is not None:
        if rank == 0:
            tier = "" if local is None else f" ({manager.restored.tier} tier)"  # type: ignore[union-attr]
            print(f"Restored from {restored}{tier} at step {int(step)} onto {world} rank(s).")
        if cursor.position != int(step) * args.global_batch:
            raise SystemExit(
                f"data position {cursor.position} does not match step {int(step)} "
                f"x global batch {args.global_batch}"
            )
    elif rank == 0:
        print("Initializing from scratch.")

    if args.check_restore_against is not None:
        expected = torch.load(args.check_restore_against, weights_only=True)
        bad = compare(full_state(model, opt, int(step)), expected)
        if bad:
            raise SystemExit(f"rank {rank}: restored state differs from the dump: {bad}")
        if rank == 0:
            print(f"Restore check passed: {len(expected) - 1} tensors bit-identical.")

    background = {"sync": {}, "async": {"async_save": True}, "lazy": {"lazy": True}}
    save_options = background[args.save_mode]
    last_saved = int(step) if restored is not None else None
    done = 0
    loss = torch.tensor(float("nan"))
    preemption = distckpt.PreemptionHandler(manager).install()
    while int(step) < args.steps and (args.stop_after is None or done < args.stop_after):
        batch = next(cursor)  # the global batch [s*B, (s+1)*B)
        start = batch[0] + rank * local_batch
        xs, ys = samples(start, start + local_batch)
        opt.zero_grad(set_to_none=True)
        loss = ((model(xs) - ys) ** 2).mean()  # local mean; FSDP2 averages over ranks
        loss.backward()
        opt.step()
        step.add_(1)
        done += 1
        if int(step) % args.every == 0:
            saved = manager.save(**save_options)
            last_saved = int(step)
            if rank == 0:
                path = saved if isinstance(saved, str) else saved.path
                print(f"step {int(step)}: local loss {loss.item():.6f}; saved {path}", flush=True)
        if preemption.save_if_preempted():  # every rank, at every step boundary
            last_saved = int(step)
            if rank == 0:
                print(f"step {int(step)}: preempted; saved {preemption.checkpoint}", flush=True)
            break
    preemption.uninstall()

    manager.sync()
    newest = manager.latest_checkpoint or ""
    last_was_local = local is not None and not newest.endswith(f"-{ckpt.save_counter}")
    if last_saved != int(step) or last_was_local:  # the end of a run goes to --dir
        path = manager.save(check_interval=False)
        if rank == 0:
            print(f"step {int(step)}: saved {path} (end of run)")
    manager.sync()

    if args.dump is not None:
        state = full_state(model, opt, int(step))
        if rank == 0:
            Path(args.dump).parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, args.dump)
            print(f"Dumped the full state at step {int(step)} to {args.dump}")

    manager.close()
    if rank == 0 and not preemption.preempted:
        print(f"Done: step {int(step)} on {world} rank(s).")
    shutdown(rank)
    preemption.exit_if_preempted()  # exit code 75: the launcher requeues or relaunches


def shutdown(rank: int) -> None:
    """Tear torch.distributed down; under MPI, rank 0 (which hosts the rendezvous store
    that ``init_torch_from_mpi`` started) goes last, once every other rank let go of it.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    under_mpi = "TORCHELASTIC_RUN_ID" not in os.environ and "mpi4py.MPI" in sys.modules
    if not under_mpi:
        dist.destroy_process_group()
        return
    from mpi4py import MPI

    if rank != 0:
        dist.destroy_process_group()
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

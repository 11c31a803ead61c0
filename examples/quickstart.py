"""distckpt quickstart: save sharded training state, then resume it on any number of ranks.

Each run restores the checkpoint in ``--dir`` if there is one (whatever world size saved
it), checks every restored value bit for bit, trains ten more (pretend) steps and saves.

    python examples/quickstart.py                                  # one process
    mpiexec -n 4 python examples/quickstart.py                     # 4 ranks under MPI
    torchrun --standalone --nproc-per-node 2 examples/quickstart.py  # resume on 2 ranks

On more than one rank the weights and Adam moments are DTensors sharded on dimension 0
over all ranks; restoring on another world size reshards them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

import distckpt

SHAPES = {"l1.weight": (64, 16), "l1.bias": (64,), "l2.weight": (4, 64), "l2.bias": (4,)}


def setup() -> tuple[int, int, object]:
    """Start torch.distributed under mpiexec or torchrun; return (rank, world, mesh)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
        torch.distributed.init_process_group("gloo")
    elif any(k.startswith(("PMI_", "OMPI_", "PMIX_")) for k in os.environ):
        distckpt.comm.init_torch_from_mpi()
    if not torch.distributed.is_initialized():
        return 0, 1, None
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    return torch.distributed.get_rank(), world, init_device_mesh("cpu", (world,))


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """The full (global) value of every parameter after ``step`` steps: deterministic."""
    gen = torch.Generator().manual_seed(1234)
    return {k: torch.randn(s, generator=gen) + 0.01 * step for k, s in SHAPES.items()}


def shard(full: torch.Tensor, mesh: object) -> torch.Tensor:
    if mesh is None:
        return full.clone()
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(full, mesh, [Shard(0)])


def make_state(step: int, mesh: object) -> dict:
    weights = weights_at(step)
    model = nn.ParameterDict(
        {k.replace(".", "_"): nn.Parameter(shard(v, mesh)) for k, v in weights.items()}
    )
    moments = {k: shard(v * 0.5, mesh) for k, v in weights.items()}
    return {
        "model": dict(model.state_dict()),
        "optimizer": {"exp_avg": moments, "lr": 0.1, "betas": (0.9, 0.999)},
        "step": step,
        "rng": distckpt.PerRank(torch.get_rng_state()),
    }


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="quickstart_ckpt", help="checkpoint directory")
    args = parser.parse_args()
    rank, world, mesh = setup()
    path = Path(args.dir) / "ckpt"

    step = 0
    if (path / "zarr.json").exists():
        # Fresh objects of the right shapes; load fills them in place, resharding as needed.
        state = make_state(0, mesh)
        state["step"] = None
        distckpt.load(state, path)
        step = state["step"]
        expected = make_state(step, mesh)
        for name, value in state["model"].items():
            if not torch.equal(local(value), local(expected["model"][name])):
                raise SystemExit(f"rank {rank}: {name} differs after restore")
        saved_on = distckpt.list_variables(path)
        if rank == 0:
            print(
                f"Restored step {step} from {path} onto {world} rank(s); "
                f"{len(saved_on)} variables, all bit-identical."
            )
    elif rank == 0:
        print("Initializing from scratch.")

    step += 10  # ... ten training steps would run here ...
    result = distckpt.save(make_state(step, mesh), path, overwrite=True)
    if rank == 0:
        print(
            f"Saved step {step} to {path} from {world} rank(s) in "
            f"{result.timings['total'] * 1000:.0f} ms."
        )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

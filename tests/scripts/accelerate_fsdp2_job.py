"""Accelerate's FSDP2 path through DistckptAccelerator, on CPU ranks, for
tests/integrations/test_integration_accelerate.py.

Accelerate turns FSDP on only for accelerators (GPUs and the like), never for CPU
processes; this job sets its state to FSDP2 by hand before and after ``prepare``, so
that Accelerate's own ``fsdp2_prepare_model`` shards the model (``fully_shard``: the
parameters and the AdamW slots are DTensors) and ``save_state`` / ``load_state`` see an
FSDP2 job. Everything else is Accelerate's and distckpt's, unchanged.

``save DIR``: (torchrun, 2 processes on gloo) 3 steps, ``save_state(DIR/ckpt)`` (an
explicit directory, no project_dir), then rank 0 keeps the full tensors (gathered from
the shards) of the model and the optimizer: the reference.

``load DIR``: (torchrun, 3 processes: uneven shards of the 8-row layer) ``load_state``
right after ``prepare``; the full tensors equal the reference bit for bit. Prints
``RESTORED <rank>`` and ``OK <rank>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from rank import assert_same, say

from distckpt.integrations.accelerate import DistckptAccelerator

mode, root = sys.argv[1], Path(sys.argv[2])


def as_fsdp2(accelerator: DistckptAccelerator) -> None:
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)


def full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters and AdamW slots, gathered whole (collective), by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict = {}
    for n, p in model.named_parameters():
        assert type(p).__name__ == "DTensor", (n, type(p))  # sharded by Accelerate
        out[f"param/{n}"] = p.full_tensor()
    for p, slots in optimizer.state.items():
        for k, v in slots.items():
            value = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"optim/{names[id(p)]}/{k}"] = value
    return out


def main() -> None:
    accelerator = DistckptAccelerator(cpu=True)
    as_fsdp2(accelerator)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    as_fsdp2(accelerator)  # prepare sets the CPU type back
    assert accelerator.is_fsdp2
    inner = opt.optimizer
    if mode == "save":
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen)
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        accelerator.save_state(str(root / "ckpt"))
        reference = full(model, inner)
        if rank == 0:
            torch.save(reference, root / "reference.pt")
    else:
        accelerator.load_state(str(root / "ckpt"))
        got = full(model, inner)
        assert_same(got, torch.load(root / "reference.pt", weights_only=True), "fsdp2")
        say(f"RESTORED {rank}")
    accelerator.wait_for_everyone()
    say(f"OK {rank}")
    accelerator.end_training()


main()

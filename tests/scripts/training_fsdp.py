"""An FSDP2 model and its Adam state: saved on N ranks, restored on M, checked bit for bit.

Usage (under torchrun, gloo on CPU)::

    training_fsdp.py save DIR      # 5 training steps, ckpt.save(DIR/ckpt); rank 0 writes
                                   # the full tensors to DIR/expected.pt for the check
    training_fsdp.py restore DIR   # fresh model and optimizer, restore, compare full tensors

Each rank prints ``OK <mode> <rank>`` as its last line when every check passed.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank import fsdp_mlp, say
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import distckpt


def build(seed: int, mesh: object) -> nn.Module:
    """An MLP whose first weight (and its Adam moments) is large enough to be written as
    per-rank pieces, not gathered as a small variable; every layer sharded with FSDP2."""
    return fsdp_mlp(seed, (96, 1024, 6, 3), mesh)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam slot as a full tensor, keyed by name (collective)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor()
        for slot, value in sorted(opt.state[p].items()):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{name}:{slot}"] = full.clone()
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build(0 if mode == "save" else 7, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cursor = distckpt.SampleCursor(size=100, batch_size=8, rank=rank, world_size=world)
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt, rng=distckpt.RNGState(), data=cursor)
    if mode == "save":
        data = torch.Generator().manual_seed(0)
        xs, ys = torch.randn(100, 96, generator=data), torch.randn(100, 3, generator=data)
        for _ in range(5):
            idx = next(cursor)
            opt.zero_grad()
            ((model(xs[idx]) - ys[idx]) ** 2).mean().backward()
            opt.step()
        path = ckpt.save(directory / "ckpt")
        expected = full_state(model, opt)
        if rank == 0:
            torch.save(expected, directory / "expected.pt")
        assert path == str(directory / "ckpt-1"), path
    else:
        latest = distckpt.latest_checkpoint(directory)
        assert latest == str(directory / "ckpt-1"), latest
        ckpt.restore(latest).assert_consumed()
        expected = torch.load(directory / "expected.pt", weights_only=True)
        got = full_state(model, opt)
        assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
        assert cursor.position == 40 and ckpt.save_counter == 1
    dist.barrier()
    say(f"OK {mode} {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""CUDA state on several ranks sharing one GPU: saved on N ranks, restored on M.

Usage (under torchrun)::

    cuda_ranks.py dtensor-save DIR [--device cuda|cpu]     # gloo, CUDA DTensors
    cuda_ranks.py dtensor-restore DIR [--device cuda|cpu]  # on another world size
    cuda_ranks.py fsdp DIR                                  # one rank, NCCL, FSDP2

With one GPU every rank uses device 0: NCCL refuses two ranks on one device, so the
multi-rank modes talk gloo (with CUDA tensors), and ``LOCAL_RANK`` is set to 0 before
``init_device_mesh("cuda", ...)``, which picks the device from it. ``--device cpu`` runs
the same checks on CPU tensors (to try the script on a machine without a GPU).

Each rank prints ``OK <mode> <rank>`` as its last line when every check passed.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank import fsdp_mlp, say
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import distckpt

#: name -> (global shape, dtype, placement): uneven shards included.
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {
    "w_bf16": ((1031, 96), torch.bfloat16, Shard(0)),
    "w_f32": ((64, 777), torch.float32, Shard(1)),
    "i64": ((301,), torch.int64, Shard(0)),
    "f8": ((40, 513), torch.float8_e4m3fn, Shard(0)),
    "rep": ((50, 20), torch.float16, Replicate()),
}


def full_value(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The same arbitrary bits on every rank and in every run, from the name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def local_part(full: torch.Tensor, placement: Any, rank: int, world: int) -> torch.Tensor:
    if isinstance(placement, Replicate):
        return full.clone()
    dim = placement.dim
    chunks = list(torch.chunk(full, world, dim=dim))
    chunks += [full.narrow(dim, 0, 0)] * (world - len(chunks))
    return chunks[rank].contiguous()


def state_for(mesh: Any, device: str, rank: int, world: int, fill: bool) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, (shape, dtype, placement) in SPECS.items():
        full = full_value(name, shape, dtype) if fill else torch.zeros(shape).to(dtype)
        # src_data_rank=None: each rank takes its own chunk, no communication
        state[name] = distribute_tensor(full.to(device), mesh, [placement], src_data_rank=None)
    rng = torch.Generator(device="cpu").manual_seed(rank)
    per_rank = torch.randn(33, generator=rng).to(device)
    state["per_rank"] = distckpt.PerRank(per_rank if fill else torch.zeros_like(per_rank))
    return state


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dtensor_mode(mode: str, directory: Path, device: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        os.environ["LOCAL_RANK"] = "0"  # one GPU: every rank on device 0
        torch.cuda.set_device(0)
    mesh = init_device_mesh(device, (world,))
    distckpt.set_staging(slab_bytes=64 << 10, slabs=3)  # many slabs per tensor
    if mode == "dtensor-save":
        state = state_for(mesh, device, rank, world, fill=True)
        result = distckpt.save(state, directory / "ckpt", io_workers=2)
        assert result.bytes_written > 0
        (directory / "saved_world").write_text(str(world))
    else:
        saved_world = int((directory / "saved_world").read_text())
        state = state_for(mesh, device, rank, world, fill=False)
        distckpt.load(state, directory / "ckpt", io_workers=3)
        for name, (shape, dtype, placement) in SPECS.items():
            got = state[name]
            assert got.to_local().device.type == device, name
            want = local_part(full_value(name, shape, dtype), placement, rank, world)
            assert bits(got.to_local()) == bits(want), f"{name} differs on rank {rank}"
        rng = torch.Generator(device="cpu").manual_seed(rank % saved_world)
        want_rank = torch.randn(33, generator=rng)
        assert bits(state["per_rank"].value) == bits(want_rank), "per-rank value differs"
    say(f"OK {mode} {rank}")
    dist.destroy_process_group()


def fsdp_mode(directory: Path) -> None:
    from torch import nn

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = fsdp_mlp(seed, (64, 512, 8), mesh, device="cuda")
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build(0)
    x, y = torch.randn(16, 64, device="cuda"), torch.randn(16, 8, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt, rng=distckpt.RNGState())
    path = ckpt.save(directory / "ckpt")
    want = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    want_slots = {
        (n, k): v.full_tensor().clone() if isinstance(v, DTensor) else v.clone()
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
    }
    after_save = torch.randn(4, device="cuda")  # the CUDA stream that a restore rewinds

    fresh, fresh_opt = build(1)
    restored = distckpt.Checkpoint(model=fresh, optimizer=fresh_opt, rng=distckpt.RNGState())
    restored.restore(path).assert_consumed()
    for name, p in fresh.named_parameters():
        assert bits(p.full_tensor()) == bits(want[name]), name
        for k, v in fresh_opt.state[p].items():
            got = v.full_tensor() if isinstance(v, DTensor) else v
            assert bits(got) == bits(want_slots[(name, k)]), (name, k)
    assert bits(torch.randn(4, device="cuda")) == bits(after_save), "CUDA RNG not restored"
    say(f"OK fsdp {rank}")
    dist.destroy_process_group()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    mode, directory = sys.argv[1], Path(sys.argv[2])
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if mode == "fsdp":
        fsdp_mode(directory)
    else:
        dtensor_mode(mode, directory, device)


if __name__ == "__main__":
    main()

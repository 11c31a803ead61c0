"""What the rank scripts share: torch.distributed started over gloo the way the launcher
(torchrun or mpiexec) asks, and the job's last line per rank."""

from __future__ import annotations

import os

import torch.distributed as dist

import distckpt
from distckpt.comm.auto import launched_by_mpi


def start() -> tuple[int, int]:
    """Start torch.distributed (gloo) from the launcher's variables: (rank, world size)."""
    if launched_by_mpi():
        distckpt.comm.init_torch_from_mpi()
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def finish(rank: int) -> None:
    """Once every rank is done: print ``OK <rank>`` (one write: the ranks share the pipe)."""
    dist.barrier()
    os.write(1, f"OK {rank}\n".encode())
    dist.destroy_process_group()

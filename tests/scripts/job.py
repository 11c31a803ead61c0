"""What the rank scripts share: torch.distributed started over gloo the way the launcher
(torchrun or mpiexec) asks, whole lines on the shared stdout, and the job's last line per
rank."""

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


def say(line: str) -> None:
    """Print ``line`` with one write(2): the ranks share the pipe, and print() writes the
    text and the newline apart (another rank's line could land between them)."""
    os.write(1, f"{line}\n".encode())


def finish(rank: int) -> None:
    """Once every rank is done: print ``OK <rank>``."""
    dist.barrier()
    say(f"OK {rank}")
    dist.destroy_process_group()

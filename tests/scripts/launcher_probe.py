"""What a job sees of its launcher (tests/comm/test_launchers.py).

Usage::

    launcher_probe.py env           # torch.distributed from the environment, one all_reduce;
                                    # prints ENV <rank> {json} (launcher variables, argv,
                                    # __name__, sys.path[0]) then OK <rank>
    launcher_probe.py fail          # rank 1 exits with 3; the others wait in a barrier
    launcher_probe.py hang          # prints PID <rank> <pid>, then waits for a signal
    launcher_probe.py mpi           # MPI: one allreduce; prints MPI <rank> <size> <sum>, OK
    launcher_probe.py mpi-exit      # MPI: rank 1 exits with 5 after the allreduce
    launcher_probe.py mpi-kill      # MPI: rank 1 is SIGKILLed after the allreduce
    launcher_probe.py mpi-signal    # MPI: prints READY <rank>, then OK <rank> on SIGUSR1
"""

from __future__ import annotations

import json
import os
import signal
import sys

from rank import say

#: The variables of torchrun's and MPI launchers that ``env`` reports.
PREFIXES = (
    "RANK",
    "LOCAL_",
    "WORLD_SIZE",
    "GROUP_",
    "ROLE_",
    "MASTER_",
    "TORCHELASTIC_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def torch_modes(mode: str) -> None:
    import torch
    import torch.distributed as dist

    if mode == "hang":
        say(f"PID {os.environ['RANK']} {os.getpid()}")
        signal.pause()
        return
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "fail":
        if rank == 1:
            sys.exit(3)
        dist.barrier()  # never passes: rank 1 is gone, and the launcher ends this one
        return
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    found = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
    seen = {"env": found, "argv": sys.argv[1:], "name": __name__, "path0": sys.path[0]}
    seen["sum"] = int(total)
    say(f"ENV {rank} {json.dumps(seen, sort_keys=True)}")
    dist.destroy_process_group()
    say(f"OK {rank}")


def mpi_modes(mode: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if mode == "mpi-signal":
        got = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
        comm.barrier()
        say(f"READY {comm.rank}")
        while not got:
            signal.pause()
        say(f"OK {comm.rank}")
        return
    total = comm.allreduce(comm.rank + 1)
    say(f"MPI {comm.rank} {comm.size} {total}")
    if comm.rank == 1 and mode == "mpi-exit":
        sys.exit(5)
    if comm.rank == 1 and mode == "mpi-kill":
        os.kill(os.getpid(), signal.SIGKILL)
    say(f"OK {comm.rank}")


if __name__ == "__main__":
    which = sys.argv[1]
    (mpi_modes if which.startswith("mpi") else torch_modes)(which)

"""Pick the communicator that matches how this process was launched."""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

from distckpt.comm.base import Communicator, resolve_timeout

logger = logging.getLogger(__name__)

#: Variables torchrun (torch.distributed.run) sets for every worker.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Variables MPI launchers set (MPICH/hydra, Intel MPI, Open MPI, PMIx-based, Slurm+PMI).
MPI_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched_by_torchrun() -> bool:
    """Whether torchrun's variables are set (a local check, no communication)."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(name in env for name in TORCHRUN_VARS)


def launched_by_mpi() -> bool:
    """Whether an MPI launcher's variables are set (a local check, no communication)."""
    env = os.environ
    return any(name in env for name in MPI_VARS) or any(k.startswith("HYDRA_") for k in env)


def auto(timeout: float | None = None) -> Communicator:
    """Collective: return a communicator for this job, found in this order.

    1. An initialized ``torch.distributed`` default group: :class:`TorchComm` over it.
    2. torchrun's variables (``TORCHELASTIC_RUN_ID``, or all of ``RANK``, ``WORLD_SIZE``,
       ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): initializes torch.distributed
       with gloo from ``env://`` and returns :class:`TorchComm` over it; at exit, unless the
       program destroyed it, every rank waits for the others (30 s at most) and destroys
       it. (Initialize the group yourself first to use NCCL for your training; distckpt
       still talks gloo.)
    3. An MPI launcher's variables (``PMI_RANK``, ``PMI_SIZE``, ``PMIX_RANK``,
       ``OMPI_COMM_WORLD_SIZE``, ``MPI_LOCALNRANKS``, ``HYDRA_*``): :class:`MPIComm` over
       ``COMM_WORLD``.
    4. Otherwise :class:`SingleComm`.

    Every rank must call it at the same point: cases 1 and 2 may create process groups,
    which are collectives. ``timeout`` (seconds) defaults to ``$DISTCKPT_TIMEOUT``, else
    :data:`~distckpt.comm.base.DEFAULT_TIMEOUT`.
    """
    seconds = resolve_timeout(timeout)
    loaded = sys.modules.get("torch.distributed")  # never initialized if never imported
    if loaded is not None and loaded.is_available() and loaded.is_initialized():
        from distckpt.comm.torch_dist import TorchComm

        logger.debug("auto: using the initialized torch.distributed default group")
        return TorchComm(timeout=seconds)
    if launched_by_torchrun():
        import torch.distributed as dist

        from distckpt.comm.torch_dist import TorchComm, tear_down_at_exit

        logger.debug("auto: torchrun variables found; initializing torch.distributed (gloo)")
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=seconds))
        tear_down_at_exit()
        return TorchComm(timeout=seconds)
    if launched_by_mpi():
        from distckpt.comm.mpi import MPIComm

        logger.debug("auto: MPI launcher variables found; using MPI.COMM_WORLD")
        return MPIComm(timeout=seconds)
    from distckpt.comm.single import SingleComm

    logger.debug("auto: no launcher found; single process")
    return SingleComm(timeout=seconds)

"""Pick the communicator that matches how this process was launched."""

from __future__ import annotations

import atexit
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


#: How long, at exit, a rank waits for the others before tearing its process group down.
_EXIT_BARRIER_SECONDS = 30.0


def _destroy_own_group() -> None:
    """At exit, tear down the process group that :func:`auto` started, unless the program
    did: left to the interpreter's teardown while another rank already exited, gloo can
    abort the process ("terminate called without an active exception") after its work is
    done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            # Every rank first reaches its exit (bounded: a rank that died is not waited
            # for long), so no rank closes its connections under another's feet.
            dist.monitored_barrier(timeout=timedelta(seconds=_EXIT_BARRIER_SECONDS))
        except Exception as exc:  # noqa: BLE001  (exiting anyway)
            logger.debug("the barrier at exit failed: %r", exc)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001  (exiting anyway)
            logger.debug("destroying the process group at exit failed: %r", exc)


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

        from distckpt.comm.torch_dist import TorchComm

        logger.debug("auto: torchrun variables found; initializing torch.distributed (gloo)")
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=seconds))
        atexit.register(_destroy_own_group)
        return TorchComm(timeout=seconds)
    if launched_by_mpi():
        from distckpt.comm.mpi import MPIComm

        logger.debug("auto: MPI launcher variables found; using MPI.COMM_WORLD")
        return MPIComm(timeout=seconds)
    from distckpt.comm.single import SingleComm

    logger.debug("auto: no launcher found; single process")
    return SingleComm(timeout=seconds)

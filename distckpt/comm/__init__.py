"""Communicators: how distckpt's ranks exchange small Python objects.

:class:`Communicator` is the protocol; :class:`SingleComm` (one process),
:class:`MPIComm` (mpi4py) and :class:`TorchComm` (torch.distributed, always over gloo)
implement it, and :func:`auto` picks one from how the job was launched.
:func:`raise_if_any_failed` makes one rank's error every rank's error, and
:func:`init_torch_from_mpi` starts torch.distributed in a job started by ``mpiexec``.

Importing this package imports neither ``mpi4py.MPI`` (which would initialize MPI) nor
``torch.distributed``; the classes that need them import them when constructed.
"""

from __future__ import annotations

from distckpt.comm.auto import auto
from distckpt.comm.base import DEFAULT_TIMEOUT, Communicator, raise_if_any_failed
from distckpt.comm.bootstrap import init_torch_from_mpi
from distckpt.comm.mpi import MPIComm
from distckpt.comm.single import SingleComm
from distckpt.comm.torch_dist import TorchComm

__all__ = [
    "DEFAULT_TIMEOUT",
    "Communicator",
    "MPIComm",
    "SingleComm",
    "TorchComm",
    "auto",
    "init_torch_from_mpi",
    "raise_if_any_failed",
]

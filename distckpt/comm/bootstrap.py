"""Start ``torch.distributed`` in a job launched by ``mpiexec`` (no torchrun needed).

``mpiexec`` sets none of torchrun's variables (``RANK``, ``MASTER_ADDR``, ...), so the
ranks agree over MPI on where torch's rendezvous store lives, then initialize the
default process group from it.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

from distckpt.comm.base import raise_if_any_failed, resolve_timeout
from distckpt.comm.mpi import MPIComm
from distckpt.comm.torch_dist import tear_down_at_exit

logger = logging.getLogger(__name__)


def _reachable_address(hostname: str) -> str:
    """An address of this host that other hosts can probably reach (rank 0 only)."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not address.startswith("127."):
            return address
    try:  # the address of the interface holding the default route; sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1, never routed anywhere for real
            address = str(probe.getsockname()[0])
            if not address.startswith(("127.", "0.")):
                return address
    except OSError:
        pass
    return hostname


def init_torch_from_mpi(backend: str = "gloo", timeout: float | None = None) -> None:
    """Collective over ``MPI.COMM_WORLD``: initialize torch.distributed's default group.

    Every rank of the MPI job must call it (once, at the same point). Nothing happens
    when the default group is already initialized. Otherwise:

    1. all ranks allgather their host names (with the MPI time-out, see :class:`MPIComm`);
    2. rank 0 picks the rendezvous address: ``$MASTER_ADDR`` if set, else ``127.0.0.1``
       when every rank runs on rank 0's host, else an address of rank 0's host; it starts
       torch's TCP store there, on ``$MASTER_PORT`` if set, else on a free port chosen by
       the operating system (port 0, so no other process can take it in between);
    3. rank 0 broadcasts (address, port); every rank sets ``RANK``, ``WORLD_SIZE``,
       ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (what
       torchrun would have set, for code such as ``DeviceMesh`` that reads them);
    4. every rank calls ``torch.distributed.init_process_group(backend, store=...,
       rank=..., world_size=..., timeout=...)`` with the MPI rank and size;
    5. at exit, unless the program destroyed it, every rank waits for the others (30 s
       at most) and destroys the group (:func:`~distckpt.comm.torch_dist.tear_down_at_exit`).

    Example::

        # mpiexec -n 4 python train.py
        from distckpt.comm import TorchComm, init_torch_from_mpi

        init_torch_from_mpi()               # every rank
        comm = TorchComm()                  # every rank, collectively
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (comm.size,))

    :param backend: torch.distributed backend (``"gloo"``, ``"nccl"``,
        ``"cpu:gloo,cuda:nccl"``). With NCCL, call
        ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` right after this returns
        (NCCL communicators are created at the first collective).
    :param timeout: seconds, for the rendezvous and as the process group's time-out; None
        means ``$DISTCKPT_TIMEOUT`` or :data:`~distckpt.comm.base.DEFAULT_TIMEOUT`.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        logger.debug("torch.distributed is already initialized; nothing to do")
        return
    seconds = resolve_timeout(timeout)
    comm = MPIComm(timeout=seconds)
    hostname = socket.gethostname()
    hosts: list[str] = comm.allgather(hostname)
    local_rank = hosts[: comm.rank].count(hostname)
    local_size = hosts.count(hostname)

    store = None
    endpoint: tuple[str, int] | None = None
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            address = os.environ.get("MASTER_ADDR") or (
                "127.0.0.1" if hosts.count(hostname) == comm.size else _reachable_address(hostname)
            )
            port = int(os.environ.get("MASTER_PORT") or 0)
            store = dist.TCPStore(
                address,
                port,
                comm.size,
                is_master=True,
                timeout=timedelta(seconds=seconds),
                wait_for_workers=False,
            )
            endpoint = (address, int(store.port))
        except Exception as exc:  # noqa: BLE001 - sent to every rank just below
            error = exc
    raise_if_any_failed(comm, error)
    address, port = comm.broadcast(endpoint, root=0)

    os.environ.update(
        RANK=str(comm.rank),
        WORLD_SIZE=str(comm.size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_size),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )
    if store is None:
        store = dist.TCPStore(
            address, port, comm.size, is_master=False, timeout=timedelta(seconds=seconds)
        )
    logger.debug("rank %d: torch.distributed rendezvous at %s:%d", comm.rank, address, port)
    dist.init_process_group(
        backend,
        store=store,
        rank=comm.rank,
        world_size=comm.size,
        timeout=timedelta(seconds=seconds),
    )
    tear_down_at_exit()

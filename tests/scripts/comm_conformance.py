"""The same communicator checks, under whichever launcher runs this script.

Usage: comm_conformance.py MODE [--size N] [--expect CLASS] [--die kill|hang]

MODE picks what is checked (every rank runs the same checks, in the same order):

* ``single``: SingleComm (plain ``python``);
* ``mpi``: MPIComm over COMM_WORLD and over an even/odd split of it (``mpiexec``);
* ``torch``: TorchComm from auto() (``torchrun``), with its own time-out and with a
  side group, over a subgroup without rank 0 (with and without a side group), and a
  split of the world;
* ``auto``: whatever auto() returns;
* ``mpi-torch``: init_torch_from_mpi() under ``mpiexec``, a DTensor on a 1-D CPU
  DeviceMesh, then TorchComm (from auto()) and MPIComm.

``--size`` is the expected job size, ``--expect`` the class name auto() must return.
``--die kill|exit|hang [--markers DIR]``: the last rank SIGKILLs itself, exits, or sleeps
before a collective; the others print ``TIMEOUT <rank>`` on CommTimeoutError (and leave
it in ``DIR``) and exit 3 (see :func:`die`).
Success ends with one ``OK <rank>`` line per rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any

from rank import say

from distckpt.comm import (
    Communicator,
    MPIComm,
    SingleComm,
    TorchComm,
    auto,
    init_torch_from_mpi,
    raise_if_any_failed,
    torch_dist,
)
from distckpt.comm.base import resolve_timeout
from distckpt.errors import CommTimeoutError, RemoteError, ValidationError


class NeedsTwoArgs(Exception):
    """Pickles, but cannot be unpickled (its __init__ wants two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def launcher_rank() -> int:
    for name in ("PMI_RANK", "RANK", "OMPI_COMM_WORLD_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def fail_here(message: str) -> None:
    raise ValueError(message)


def expect_raise(comm: Communicator, exc: BaseException | None) -> BaseException:
    try:
        raise_if_any_failed(comm, exc)
    except BaseException as raised:  # noqa: BLE001 - inspected by the caller
        return raised
    raise AssertionError(f"rank {comm.rank}: raise_if_any_failed did not raise")


def check_failures(comm: Communicator) -> None:
    rank, last = comm.rank, comm.size - 1

    raise_if_any_failed(comm, None)  # nobody failed: returns

    # exactly one rank (the last) fails
    message = f"boom on rank {last} of {comm.size}"
    mine: BaseException | None = None
    if rank == last:
        try:
            fail_here(message)
        except ValueError as exc:
            mine = exc
    got = expect_raise(comm, mine)
    assert type(got) is ValueError, (rank, repr(got))
    assert str(got) == message, (rank, str(got))
    assert got.rank == last, (rank, got.rank)  # type: ignore[attr-defined]
    if rank == last:
        assert got is mine, "the failing rank must re-raise its own exception object"
    else:
        notes = "\n".join(getattr(got, "__notes__", []))
        assert f"rank {last}" in notes, notes
        assert "Traceback" in notes and "fail_here" in notes and message in notes, notes

    # two ranks fail: the lowest one's error wins everywhere, with its type
    if comm.size >= 2:
        mine = None
        if rank == 0:
            mine = ValidationError("first")
        elif rank == last:
            mine = KeyError("second")
        got = expect_raise(comm, mine)
        assert type(got) is ValidationError and str(got) == "first", (rank, repr(got))
        assert got.rank == 0  # type: ignore[attr-defined]
        assert (got is mine) == (rank == 0)

    # exceptions that cannot travel become RemoteError elsewhere, themselves at home
    class LocalOnly(Exception):  # a local class cannot be pickled
        pass

    for make in (lambda: LocalOnly("local trouble"), lambda: NeedsTwoArgs("x", "y")):
        mine = make() if rank == last else None
        got = expect_raise(comm, mine)
        assert got.rank == last  # type: ignore[attr-defined]
        if rank == last:
            assert got is mine
        else:
            assert type(got) is RemoteError, (rank, repr(got))
            name = "LocalOnly" if "local" in str(got) else "NeedsTwoArgs"
            assert str(got).startswith(name + ": "), str(got)
    pickle.dumps(NeedsTwoArgs("a", "b"))  # the premise of the test above


def check_collectives(comm: Communicator, size: int, rank: int | None = None) -> None:
    """Every collective of the protocol; ``size``/``rank`` are what the launcher says."""
    assert comm.size == size, (comm.size, size)
    if rank is not None:
        assert comm.rank == rank, (comm.rank, rank)
    assert 0 <= comm.rank < comm.size
    assert comm.timeout > 0
    r, n, last = comm.rank, comm.size, comm.size - 1

    comm.barrier()
    comm.barrier()

    def item(k: int) -> dict[str, Any]:
        return {"rank": k, "payload": list(range(k + 1)), "text": "é" * k}

    for root in sorted({0, last}):
        assert comm.broadcast(item(r), root=root) == item(root)
        assert comm.broadcast(None, root=root) is None
        gathered = comm.gather(item(r), root=root)
        if r == root:
            assert gathered == [item(k) for k in range(n)], gathered
        else:
            assert gathered is None, gathered
        blobs = comm.gather_bytes(bytes([r % 256]) * (r % 3), root=root)  # rank 0: empty
        if r == root:
            assert blobs == [bytes([k % 256]) * (k % 3) for k in range(n)], blobs
        else:
            assert blobs is None
    assert comm.allgather(item(r)) == [item(k) for k in range(n)]
    assert comm.allgather(None) == [None] * n

    big = os.urandom(1 << 20) if r == last else b""  # one large buffer, others empty
    digest = comm.broadcast(big, root=last)
    blobs = comm.gather_bytes(big, root=0)
    if r == 0:
        assert blobs is not None and blobs[last] == digest and len(blobs[last]) == 1 << 20
        assert all(b == b"" for k, b in enumerate(blobs) if k != last)

    for bad_root in (-1, n):
        for call in (comm.broadcast, comm.gather, comm.gather_bytes):
            try:
                call(b"", root=bad_root)
            except ValueError:
                pass
            else:
                raise AssertionError(f"{call.__name__} accepted root {bad_root}")

    check_failures(comm)
    assert comm.allgather(r) == list(range(n))  # still usable after all those errors


def check_mpi(size: int) -> None:
    from mpi4py import MPI

    comm = MPIComm()
    check_collectives(comm, size, launcher_rank())
    if size >= 2:  # a sub-communicator: even and odd ranks
        world = MPI.COMM_WORLD
        sub = world.Split(color=world.rank % 2, key=world.rank)
        members = [k for k in range(size) if k % 2 == world.rank % 2]
        check_collectives(MPIComm(sub, timeout=30), len(members), members.index(world.rank))
        sub.Free()


def check_torch(size: int) -> None:
    import torch.distributed as dist

    comm = auto()
    assert type(comm).__name__ == "TorchComm", comm
    check_collectives(comm, size, launcher_rank())
    # the same world group, another time-out: a gloo side group (cached)
    other = TorchComm(timeout=comm.timeout + 17)
    assert other.timeout == comm.timeout + 17 and other._pg is not comm._pg
    assert TorchComm(timeout=comm.timeout + 17)._pg is other._pg
    check_collectives(other, size, launcher_rank())
    if size >= 2:
        ranks = list(range(1, size))
        sub = dist.new_group(ranks=ranks)  # every rank creates it; members use it
        if dist.get_rank() in ranks:
            plain = TorchComm(sub)  # a gloo subgroup, no time-out asked for: the group itself
            assert plain._pg is sub
            check_collectives(plain, size - 1, dist.get_rank() - 1)
            side = TorchComm(sub, timeout=11)
            assert side._pg is not sub
            check_collectives(side, size - 1, dist.get_rank() - 1)
        comm.barrier()
        # A program that makes a new group over the same ranks again and again (and
        # destroys it) gets distckpt's side group, background group and splits of the
        # first one: no new groups (each with its threads).
        made = None
        for again in range(4):
            group = dist.new_group(ranks=ranks)
            if dist.get_rank() in ranks:
                side = TorchComm(group, timeout=11)
                check_collectives(side, size - 1, dist.get_rank() - 1)
                side.background().barrier()
                side.split(0)
                count = len(torch_dist._OWN_GROUPS)
                if made is None:
                    made = count
                elif count != made:
                    fail_here(
                        f"{count} groups of distckpt's after group {again}, {made} after the first"
                    )
            if dist.get_rank() in ranks:
                dist.destroy_process_group(group)
            comm.barrier()
        # Ranks 0 and 1 now belong to different numbers of groups (rank 0 is not in
        # ``sub``), as in Megatron-LM's layouts: a split of the world still agrees on
        # its groups' names (a name derived from each rank's own count would hang).
        rank = launcher_rank()
        pair = comm.split(0 if rank < 2 else -1)
        assert (pair is None) == (rank >= 2), pair
        if pair is not None:
            check_collectives(pair, 2, rank)
        assert comm.split(0 if rank < 2 else -1) is pair  # cached: no new group
        comm.barrier()


def check_mpi_torch(size: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init_torch_from_mpi(timeout=60)
    init_torch_from_mpi()  # already initialized: nothing happens
    assert dist.get_rank() == launcher_rank() and dist.get_world_size() == size
    assert os.environ["RANK"] == str(dist.get_rank())
    assert os.environ["WORLD_SIZE"] == str(size)
    assert os.environ["LOCAL_RANK"] == str(dist.get_rank())  # one host
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"

    mesh = init_device_mesh("cpu", (size,))
    full = torch.arange(4 * size * 3, dtype=torch.float32).reshape(4 * size, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    assert dt.to_local().shape == (4, 3)
    assert torch.equal(dt.to_local(), full[4 * dist.get_rank() : 4 * dist.get_rank() + 4])
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full)

    asked = os.environ.pop("DISTCKPT_TIMEOUT", None)
    plain = TorchComm()  # a gloo group and no time-out asked for: the group's time-out
    assert plain.timeout == 60 and plain._pg is not dist.group.WORLD, plain
    check_collectives(plain, size, launcher_rank())
    os.environ["DISTCKPT_TIMEOUT"] = "61"  # the user's setting wins over the group's
    assert TorchComm().timeout == 61
    if asked is None:
        del os.environ["DISTCKPT_TIMEOUT"]
    else:
        os.environ["DISTCKPT_TIMEOUT"] = asked
    comm = auto()  # $DISTCKPT_TIMEOUT or DEFAULT_TIMEOUT: a side group
    assert type(comm).__name__ == "TorchComm", comm
    assert comm.timeout == resolve_timeout(None) and comm._pg is not dist.group.WORLD
    check_collectives(comm, size, launcher_rank())
    check_mpi(size)


def die(mode: str, markers: str | None) -> None:
    """The last rank dies (or hangs) before a collective; the others must not hang.

    ``kill``: SIGKILL; ``exit``: ``os._exit(9)``, no signal (MPICH's hydra SIGKILLs every
    rank once it reaps one a signal killed, even under ``-disable-auto-cleanup``);
    ``hang``: sleep. The others note a launcher's SIGTERM (torchrun's teardown) and
    SIGUSR1 (hydra's notice of a dead rank) and carry on, so that what is seen is how the
    collective itself gives up: ``TIMEOUT <rank> after <s> s``, also left in
    ``markers/timeout-<rank>`` (a launcher that ends the job may lose output); each
    waits for the others' markers before it exits (the first exit ends the job). Under
    MPI that exit is a normal one, so what ends the job is MPIComm's ``MPI_Abort`` at
    exit, which the test sees in hydra's report."""
    comm = auto()
    if markers is not None:  # distckpt's log too: hydra may drop an aborting rank's output
        log = logging.FileHandler(os.path.join(markers, f"log-{comm.rank}"))
        logging.getLogger("distckpt").addHandler(log)
    say(f"READY {comm.rank} {type(comm).__name__} timeout={comm.timeout:g}")
    comm.barrier()
    last = comm.size - 1
    if comm.rank == last:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(9)
        time.sleep(120)
        say(f"AWOKE {comm.rank}")
        return

    def noted(signum: int, _frame: Any) -> None:
        say(f"SIGNAL {comm.rank} {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, noted)
    signal.signal(signal.SIGUSR1, noted)
    start = time.monotonic()
    try:
        comm.allgather(comm.rank)
    except CommTimeoutError as exc:
        line = f"TIMEOUT {comm.rank} after {time.monotonic() - start:.1f} s"
        say(f"{line}: {exc}")
        if markers is not None:
            with open(os.path.join(markers, f"timeout-{comm.rank}"), "w") as f:
                f.write(line)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(markers, f"timeout-{r}")) for r in range(last)
            ):
                time.sleep(0.02)
        if isinstance(comm, MPIComm):
            # a normal exit: MPIComm's abort at exit (MPI_Abort) must end the whole job,
            # the hung rank too, rather than leave that to the launcher's clean-up
            sys.exit(3)
        os._exit(3)  # as a job that lost a rank ends (torchrun then stops the others)
    raise AssertionError(f"rank {comm.rank}: allgather with a dead rank returned")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["single", "mpi", "torch", "auto", "mpi-torch"])
    parser.add_argument("--size", type=int, default=1)
    parser.add_argument("--expect", default=None)
    parser.add_argument("--die", choices=["kill", "exit", "hang"], default=None)
    parser.add_argument("--markers", default=None)
    args = parser.parse_args()

    if args.die:
        die(args.die, args.markers)
        return
    if args.expect is not None and args.mode != "mpi-torch":
        found = type(auto()).__name__
        assert found == args.expect, f"auto() returned {found}, expected {args.expect}"
    if args.mode == "single":
        check_collectives(SingleComm(), 1, 0)
        # neither importing distckpt.comm nor auto() outside any launcher starts MPI
        assert "mpi4py.MPI" not in sys.modules, "mpi4py.MPI was imported"
    elif args.mode == "mpi":
        check_mpi(args.size)
    elif args.mode == "torch":
        check_torch(args.size)
    elif args.mode == "auto":
        check_collectives(auto(), args.size, launcher_rank())
    else:
        check_mpi_torch(args.size)
    rank = launcher_rank()
    say(f"OK {rank}")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        print(f"FAILED rank {launcher_rank()}:\n{traceback.format_exc()}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not wait in MPI_Finalize for ranks that may still be blocked
